"""``RunConfig``: the typed root of a composed run."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Dict, Tuple

from omegaconf import MISSING

from .backend import BackendConfig, DeviceConfig
from .optimizer import OptimizerConfig
from .precision import PrecisionConfig
from .readonly import ReadOnly
from .sections import CheckpointConfig, DataConfig, LoopConfig, PluginsConfig, SweepConfig

#: The sections a stage may override.
STAGE_KEYS = ("device", "backend", "optimizer", "precision", "data", "loop", "checkpoint")


class Mode(str, Enum):
    fit = "fit"
    validate = "validate"
    check = "check"
    test = "test"
    predict = "predict"


@dataclass
class RunConfig(ReadOnly):
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """The device type (group ``device``)."""
    backend: Any = field(default_factory=BackendConfig)
    """The backend settings (group ``backend``; defaults to the ``device`` choice): after ``to_run_config``
    an instance of the schema of ``backend.type``'s backend (e.g. ``CsxConfig``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule (group ``optimizer``)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision policy (group ``precision``)."""
    model: Any = MISSING
    """``_target_`` of a ``torch.nn.Module`` whose ``forward(batch)`` returns the loss or a dict with ``loss``."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets (``_target_``) and loader settings."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Length of training, evaluation and logging cadence."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention and resume."""
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    """Extra plugins to enable, plugins to disable."""
    metrics: Dict[str, Any] = field(default_factory=dict)
    """Evaluation metrics by name, each a ``_target_`` (a torchmetrics ``Metric``: ``pip install
    "csframework[metrics]"``) with its keyword arguments and ``inputs``, the evaluation outputs its
    ``update`` gets (default ``[preds, target]``); computed over each evaluation set as ``<set>/<name>``
    (``builtin/eval_metrics.py``)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """What a multirun optimises and plots: ``objective`` (a metric name) and ``direction``."""
    stages: Dict[str, Any] = field(default_factory=dict)
    """Optional multi-phase run: stage name -> partial run config (any of ``STAGE_KEYS``), run in order,
    each continuing from the previous stage's weights."""
    seed: int = 0
    """Seed of every random generator (model init, data order, dropout): ``0 ... 2**32 - 1`` (4294967295, the
    range of NumPy's seed); another value is refused at ``mode=check``. The seeds derived from it (each
    epoch's data order, each evaluation's draw) stay within ``torch.Generator``'s 64 bits for every seed."""
    mode: Mode = Mode.fit
    """``fit`` (train), ``validate`` (evaluate ``data.val`` once, the weights of ``checkpoint.resume`` when set),
    ``test`` (evaluate the test sets once, ``data.test``, with the best checkpoint of the run directory
    ``checkpoint.resume`` names, else its newest), ``predict`` (write the model's outputs for
    ``data.predict`` to ``predictions.jsonl``, with those weights too) or ``check`` (compose, validate,
    build; train nothing)."""
    debug: bool = False
    """Show Python tracebacks for errors that are otherwise reported in one line per problem."""
    selected: ClassVar[Tuple[str, ...]] = ()
    """Set on the instance by composition, not a config key (so ``--help`` and ``--cfg`` do not show it):
    the config groups (``device``/``backend``) the user chose explicitly."""

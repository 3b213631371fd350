"""The eval_metrics plugin: the metrics of the config's ``metrics:`` section, computed over each evaluation
set with torchmetrics (the ecosystem's metrics library: whole-set R², AUROC, perplexity ... synchronised
across DDP ranks by the library itself)::

    metrics:
      mae: {_target_: torchmetrics.MeanAbsoluteError}
      r2: {_target_: torchmetrics.R2Score}
      ppl: {_target_: torchmetrics.text.Perplexity, inputs: [logits, target]}

Each entry is a ``_target_`` building a metric (a torchmetrics ``Metric``, or any object with ``update``,
``compute`` and ``reset``) with its other keys as keyword arguments, except ``inputs``: the keys of the
model's evaluation outputs (``forward``'s dict) passed to ``update`` in order, ``[preds, target]`` by
default (``labels`` for ``target`` when the outputs have no ``target`` but ``labels``, as
``csframework.models.Supervised`` returns). At each evaluation set's start the metrics are reset, every batch updates them, and at its end
``<set>/<name>`` (``val/mae``) is reported with the set's other metrics (one log line, ``metrics.csv``,
``summary.json``; ``on_eval_end`` hooks see it, so ``checkpoint.keep_best.monitor`` can name it). Under DDP
the padding rows that make the ranks' shares equal are left out, so each sample counts once.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from omegaconf import DictConfig

from ..config import plain
from ..errors import ConfigError
from ..hookspecs import hookimpl

#: How a run without torchmetrics gets it.
INSTALL = 'pip install "csframework[metrics]"'
#: The output keys ``update`` gets when an entry names none.
DEFAULT_INPUTS = ["preds", "target"]


def _entry(name: str, spec: Any) -> tuple[dict, list[str]]:
    """The keyword arguments (with ``_target_``) and input keys of ``metrics.<name>``; a ``ConfigError``
    naming the key when it is not a ``_target_`` with a list of key names as ``inputs``."""
    spec = {"_target_": spec} if isinstance(spec, str) else plain(spec) if isinstance(spec, (dict, DictConfig)) else {}
    if not isinstance(spec.get("_target_"), str):
        raise ConfigError(f"metrics.{name}: needs a _target_ naming a metric class (e.g. "
                          f"metrics.{name}._target_=torchmetrics.MeanAbsoluteError)")
    inputs = spec.pop("inputs", DEFAULT_INPUTS)
    if not isinstance(inputs, list) or not inputs or not all(isinstance(k, str) for k in inputs):
        raise ConfigError(f"metrics.{name}.inputs: {inputs!r} must name the evaluation outputs update() gets, "
                          "in order (e.g. [preds, target])")
    if spec["_target_"].split(".")[0] == "torchmetrics" and importlib.util.find_spec("torchmetrics") is None:
        raise ConfigError(f"metrics.{name}: {spec['_target_']} needs torchmetrics, which is not installed; "
                          f"{INSTALL}")
    return spec, inputs


def build_metric(name: str, spec: Any) -> tuple[Any, list[str]]:
    """The metric of ``metrics.<name>`` and its input keys, or a ``ConfigError`` naming the key."""
    from ..targets import build

    kwargs, inputs = _entry(name, spec)
    metric = build(kwargs, f"metrics.{name}")
    missing = [m for m in ("update", "compute", "reset") if not callable(getattr(metric, m, None))]
    if missing:
        raise ConfigError(f"metrics.{name}: {kwargs['_target_']} built a {type(metric).__name__} without "
                          f"{', '.join(missing)}; give a torchmetrics Metric (or an object with update, compute "
                          "and reset)")
    return metric, inputs


def real_rows(run: Any, batch_idx: int, rows: int) -> int:
    """How many of an evaluation batch's first ``rows`` rows are samples, not the padding a rank gets so
    that every rank reads as many (``sampling.ResumableSampler``: local row ``j`` of rank ``r`` is
    position ``j * world_size + r`` of the set's order, and positions from its size on are padding)."""
    loader = run.eval_loaders.get(run.eval_set)
    count = getattr(getattr(loader, "position", None), "count", None)
    if run.world_size == 1 or count is None:  # one process, or an IterableDataset (not padded)
        return rows
    mine = -(-(count - run.rank) // run.world_size)  # this rank's samples of the set
    return max(0, min(rows, mine - batch_idx * loader.samples_per_batch))


class EvalMetricsPlugin:
    name = "eval_metrics"

    def __init__(self):
        self.metrics: dict[str, tuple[Any, list[str]]] = {}
        self.device: Any = None  # where the metrics' states are: the outputs' device

    @hookimpl
    def csframework_validate(self, config) -> list[str]:
        """Every entry builds (so ``mode=check`` reports a missing torchmetrics, a typo, a bad argument)."""
        problems = []
        for name, spec in (config.metrics or {}).items():
            try:
                build_metric(str(name), spec)
            except ConfigError as e:
                problems.append(str(e))
        return problems

    @hookimpl
    def on_fit_start(self, run):
        self.metrics = {str(n): build_metric(str(n), spec) for n, spec in (run.config.metrics or {}).items()}
        self.device = None

    @hookimpl
    def on_eval_epoch_start(self, run):
        for metric, _ in self.metrics.values():
            metric.reset()

    @hookimpl
    def on_eval_batch_end(self, run, outputs, batch_idx):
        for name, (metric, inputs) in self.metrics.items():
            if inputs is DEFAULT_INPUTS and "target" not in outputs and "labels" in outputs:
                inputs = ["preds", "labels"]  # csframework.models.Supervised's name for the targets
            missing = [k for k in inputs if k not in outputs]
            if missing:
                raise ConfigError(f"metrics.{name}.inputs: the model's evaluation outputs have no {missing[0]!r} (it "
                                  f"returns {', '.join(sorted(outputs))}); return it from forward, or name the "
                                  f"outputs to use (metrics.{name}.inputs=[<preds key>, <target key>])")
            args = [outputs[k] for k in inputs]
            first = args[0]
            if not hasattr(first, "device"):
                raise ConfigError(f"metrics.{name}.inputs: output {inputs[0]!r} is a {type(first).__name__}, not a "
                                  "tensor; name a tensor output")
            if self.device != first.device and hasattr(metric, "to"):
                for each, _ in self.metrics.values():
                    each.to(first.device)
                self.device = first.device
            if run.world_size > 1 and first.ndim:
                keep = real_rows(run, batch_idx, len(first))
                args = [a[:keep] for a in args]
            metric.update(*args)

    @hookimpl
    def on_eval_epoch_end(self, run):
        values = {}
        for name, (metric, _) in self.metrics.items():
            value = metric.compute()  # torchmetrics: the whole set, gathered from every rank
            numel = value.numel() if hasattr(value, "numel") else 1
            if numel != 1:
                raise ConfigError(f"metrics.{name}: it computes {numel} numbers (shape {list(value.shape)}), not one; "
                                  "set its averaging (e.g. average=macro) or report the parts from a plugin")
            values[f"{run.eval_set}/{name}"] = float(value)
        if values:
            run.report(values)  # during an evaluation: joins the set's metrics (Run.report)

    @hookimpl
    def on_fit_end(self, run):
        self.metrics = {}


__all__ = ["DEFAULT_INPUTS", "EvalMetricsPlugin", "INSTALL", "build_metric", "real_rows"]

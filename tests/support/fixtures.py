"""Small models, datasets and plugins for tests (importable as ``fixtures``; CLI tests put tests/ on
PYTHONPATH)."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import textwrap
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import csframework as csf


class Blobs(Dataset):
    """A deterministic classification set: ``n`` points in ``dim`` dimensions around ``classes`` centres."""

    def __init__(self, n: int = 256, dim: int = 8, classes: int = 4, seed: int = 0, noise: float = 0.5):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 2
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centres[self.y] + noise * torch.randn(n, dim, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def tensor_blobs(**kwargs) -> TensorDataset:
    """The ``Blobs`` samples as a ``TensorDataset``: read by the batched fast path (``csframework.batched``)."""
    blobs = Blobs(**kwargs)
    return TensorDataset(blobs.x, blobs.y)


class AugmentedBlobs(Blobs):
    """``Blobs`` with random noise added to the inputs each time a sample is read, sample by sample
    (``__getitem__``) or a batch at once (``__getbatch__``, the batched fast path's opt-in)."""

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]

    def __getbatch__(self, indices):
        return [self.x[indices] + 0.1 * torch.randn(len(indices), self.x.shape[1]), self.y[indices]]


def mlp(dim: int = 8, hidden: int = 16, classes: int = 4, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes))


def unbuildable_mlp(**kwargs) -> nn.Module:
    """A user's network with a bug in its construction (``model.net._target_=fixtures.unbuildable_mlp``)."""
    raise RuntimeError("a bug in the network's __init__")


class ForwardFails(nn.Module):
    """A user's network that builds and raises in ``forward`` (``model.net._target_=fixtures.ForwardFails``)."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 4):
        super().__init__()
        self.layer = nn.Linear(dim, classes)

    def forward(self, x):
        raise ValueError("a bug in the network's forward")


#: The test config directory (``compose(..., config_dir=CONF)``, ``--config-dir``) and overrides for a fast
#: run on the Blobs set with a small MLP (add loop.max_steps etc. as needed).
CONF = str(Path(__file__).parent / "conf")

#: Where subprocesses find the test helpers and the test modules (models named by ``_target_``).
TEST_PATHS = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "unit"), str(Path(__file__).parents[1] / "e2e")]


def pythonpath(*first: str) -> str:
    """``PYTHONPATH`` for a ``python -m csframework`` subprocess: ``first``, the test paths, then the caller's."""
    return os.pathsep.join([*first, *TEST_PATHS, os.environ.get("PYTHONPATH", "")])
TINY = ["model=blobs_mlp", "data=blobs", "loop.max_steps=8", "loop.eval_every=null", "loop.eval_steps=null",
        "loop.log_every=2", "optimizer=sgd", "optimizer.lr=0.1"]


def compose(*overrides: str):
    """``csf.compose`` of the tiny run plus ``overrides``."""
    return csf.compose(TINY + list(overrides), config_dir=CONF)


def fit(tmp_path, *overrides, plugins=()):
    """Build the tiny run plus ``overrides`` in ``tmp_path`` and fit it; returns (run, summary)."""
    run = csf.Run(compose(*overrides), output_dir=tmp_path, plugins=plugins)
    return run, run.fit()


class Recorder:
    """Records every hook call by name (and the global step when it ran)."""

    name = "recorder"

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, hook):  # pragma: no cover - pluggy looks hooks up by attribute
        raise AttributeError(hook)


def _make_recording_hook(hook_name):
    @csf.hookimpl
    def hook(self, run):
        self.calls.append((hook_name, run.global_step))

    hook.__name__ = hook_name
    return hook


for _name in ["on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
              "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_eval_start",
              "on_eval_end", "on_eval_epoch_start", "on_eval_epoch_end", "on_eval_batch_start",
              "on_eval_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_log_metrics", "on_checkpoint_save", "on_checkpoint_load", "on_exception"]:
    setattr(Recorder, _name, _make_recording_hook(_name))


def events(run_dir: Path) -> list[dict]:
    """The events of ``events.jsonl`` in ``run_dir``."""
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


class StopAt:
    """Asks the run to stop (as SIGINT would) when step ``step`` begins."""

    name = "stop_at"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_batch_start(self, run):
        if run.global_step == self.step:
            run.state.request_stop(signal.SIGINT)


class FinalParams:
    """Writes the model's state dict as the fit ends to ``final_params.pt`` in the run directory
    (``plugins.enable=[fixtures:FinalParams]``): what a CLI run ended with, to compare what is read back."""

    name = "final_params"

    @csf.hookimpl
    def on_fit_end(self, run):
        buffer = io.BytesIO()
        torch.save(run.model.state_dict(), buffer)
        run.files.write("final_params.pt", buffer.getvalue())


class PoisonAt:
    """Makes the loss NaN from step ``step`` on (a weight becomes NaN just before it)."""

    name = "poison_at"

    def __init__(self, step: int):
        self.step = step

    @csf.hookimpl
    def on_train_batch_start(self, run):
        if run.global_step == self.step - 1:
            next(run.model.parameters()).data.fill_(float("nan"))


def pip_install_target(source: Path, site: Path) -> None:
    """``pip install`` a source tree into ``site`` (a real install: dist-info, entry points), leaving the
    environment's own packages alone."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def one_line(error: BaseException) -> str:
    """The error's message, checked to be one line (what the CLI prints after ``csframework: error:``)."""
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a missing parent package, ``hydra_plugins``, counts as missing)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def needs(module: str):
    """Skip a test when ``module`` (an optional extra's) is not installed."""
    import pytest

    return pytest.mark.skipif(not installed(module),
                              reason=f"{module} is not installed (pip install -e '.[{module.split('.')[-1].split('_')[0]}]')")


def user_project(tmp_path_factory, modules: dict[str, str]) -> Path:
    """A user's project directory: ``modules`` (file name -> source, dedented) beside a copy of ``CONF``."""
    root = tmp_path_factory.mktemp("project")
    for name, text in modules.items():
        (root / name).write_text(textwrap.dedent(text))
    shutil.copytree(CONF, root / "conf")
    return root

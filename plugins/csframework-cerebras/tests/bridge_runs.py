"""What the bridge's tests share (``conftest.py`` makes the compared runs a fixture). cstorch keeps one
backend per process (and refuses a second of another type), so each run is a fresh ``python -m csframework``
process (``CsfRunner.cli``); this directory is put on its ``PYTHONPATH`` (the nets and plugins of
``fidelity_nets.py`` and ``bridge_plugins.py``)."""
import os
from pathlib import Path

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
BRIDGE = ["backend=cerebras", "backend.type=CPU"]
EMULATOR = ["device=csx", "backend.graph_compiler=none"]
#: The run every comparison trains: 12 SGD steps with momentum, a warm-up then a cosine decay, an evaluation
#: every 5 steps and a checkpoint every 3 (keeping 2).
COMPARED = ["loop.max_steps=12", "loop.eval_every=5", "loop.log_every=2", "checkpoint.every_steps=3",
            "checkpoint.keep_last=2", "optimizer.momentum=0.9", "optimizer.schedule.name=cosine",
            "optimizer.schedule.warmup_steps=2"]


def cli(runner, overrides, **kw):
    """``python -m csframework`` (the tiny run of ``csframework.testing`` + ``overrides``) with only the
    cerebras plugin loaded."""
    return runner.cli(overrides, autoload=["cerebras"], env=dict(ENV, **kw.pop("env", {})), **kw)

"""``benchmarks.loop_overhead`` compares the same work: the hand-written loop's optimizer has the framework's
default param groups (weight decay on the matrices, none on the biases: ``optimizer.weight_decay_exclude``),
so both sides run the same optimizer kernels a step."""
import tempfile

import torch

import csframework as csf
from benchmarks import loop_overhead
from csframework.models import Supervised


def _groups(optimizer: torch.optim.Optimizer, names: dict) -> list[tuple[list[str], float]]:
    return sorted((sorted(names[id(p)] for p in g["params"]), g["weight_decay"]) for g in optimizer.param_groups)


def test_the_hand_loop_has_the_frameworks_param_groups(monkeypatch):
    monkeypatch.setenv("CSF_BENCH_MODEL", "tiny")
    monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", "0")
    with tempfile.TemporaryDirectory() as workdir:
        run = csf.Run(loop_overhead.framework_config("premade", 2, 32), output_dir=workdir)
        framework = _groups(run.optimizer, {id(p): n for n, p in run.model.named_parameters()})
        run.release()
    hand = Supervised(net=loop_overhead.mlp(), loss="cross_entropy")  # the hand loop's model
    by_name = {id(p): n for n, p in hand.named_parameters()}
    assert _groups(loop_overhead.adamw(hand), by_name) == framework
    assert len(framework) == 2  # matrices decayed, biases not

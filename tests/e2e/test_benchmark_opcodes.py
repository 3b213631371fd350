"""benchmarks/opcodes.py: a step's bytecode count is the difference of two counted runs over their steps."""
import pytest

from benchmarks import opcodes

pytestmark = pytest.mark.slow


def test_both_sides_are_counted_per_step_and_the_framework_runs_its_own_loop():
    steps = (20, 40)
    results = opcodes.measure(steps)
    hand, framework = (opcodes.per_step(results[side], "opcodes", steps) for side in ("hand", "framework"))
    assert 0 < sum(hand.values()) < sum(framework.values())
    [epoch] = [name for name in framework if name.startswith("loop.py:") and name.endswith(":train_epoch")]
    assert framework[epoch] > 0 and epoch not in hand
    # the hand loop's pre-made batches are made outside its count
    assert not any(name.endswith(":premade_batches") for name in hand)
    assert opcodes.per_step(results["framework"], "c_calls", steps)["isinstance"] > 0

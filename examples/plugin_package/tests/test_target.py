"""The plugin through csframework.testing's ``csf_runner`` fixture: a tiny fit (20 SGD steps, evaluation
every 5) with only this package's entry point loaded."""
import pytest

ONLY = ["target"]


def test_the_run_stops_at_the_first_evaluation_that_reaches_the_target(csf_runner):
    free = csf_runner.run(autoload=ONLY)  # no target: the whole run, and its evaluations
    accuracy = free.series("val/accuracy")
    assert free.exit_code == 0 and free.summary["global_step"] == 20
    goal = accuracy[1][1]  # the second evaluation's accuracy, reached by step 10 at the latest
    first = next(step for step, value in accuracy if value >= goal)

    stopped = csf_runner.run(overrides=["target.metric=val/accuracy", "target.mode=max", f"target.value={goal}"],
                             autoload=ONLY)
    assert stopped.exit_code == 0
    assert stopped.summary["global_step"] == first and stopped.summary["target_reached_at"] == first
    assert stopped.summary["stop_reason"] == f"val/accuracy reached {goal}"
    assert any(e["event"] == "target_reached" for e in stopped.events)


def test_it_does_nothing_until_a_value_is_set(csf_runner):
    result = csf_runner.run(autoload=ONLY)
    assert result.summary["global_step"] == 20 and "target_reached_at" not in result.summary


def test_a_metric_that_is_no_evaluation_metric_is_refused(csf_runner):
    result = csf_runner.run(overrides=["target.metric=accuracy", "target.value=0.9"], autoload=ONLY)
    assert result.exit_code == 2
    assert "target.metric: 'accuracy' is no evaluation metric" in str(result.error)


@pytest.mark.parametrize("disable", [["plugins.disable=[target]"]])
def test_plugins_disable_turns_it_off(csf_runner, disable):
    result = csf_runner.run(overrides=[*disable, "target.value=100.0"], autoload=ONLY)
    assert result.exit_code == 2  # its section goes with it: the key is unknown

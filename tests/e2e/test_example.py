"""examples/classify works as its README says (issue 2): the user's own model, data, config directory and
plugin, run with the README's exact commands from the example's directory."""
import json

import pytest

from example import README, shell

pytestmark = pytest.mark.slow

RUN = "python -m csframework --config-dir conf +experiment=spirals hydra.run.dir=outputs/spirals"
RESUME = RUN + " loop.max_steps=900 checkpoint.resume=auto"
SPELLED_OUT = next(line for line in README.splitlines()
                   if line.startswith("python -m csframework --config-dir conf model=spiral_mlp"))


def test_example_trains_to_high_accuracy_and_its_plugin_keeps_state_across_resume(tmp_path):
    run_dir = tmp_path / "spirals"
    first = shell(RUN, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 600
    assert summary["metrics"]["val/accuracy"] > 0.8

    # the plugin: the best of the six evaluations, reported on the console, in events.jsonl and its file
    best = json.loads((run_dir / "best_accuracy.json").read_text())
    assert best["metric"] == "val/accuracy" and best["restored"] is False
    assert best["best"] >= summary["metrics"]["val/accuracy"] and best["step"] in range(100, 601, 100)
    evals = [float(line.split(",")[3]) for line in (run_dir / "metrics.csv").read_text().splitlines()
             if line.split(",")[2] == "val/accuracy"]
    assert len(evals) == 6 and best["best"] == pytest.approx(max(evals))
    assert "best_accuracy " in first.stderr and f"at_step={best['step']}" in first.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-2:] == ["best_accuracy", "fit_end"]

    # extend the run: the plugin's best comes back from the checkpoint of step 600
    second = shell(RESUME, run_dir)
    assert "best_accuracy_restored" in second.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 900
    resumed = json.loads((run_dir / "best_accuracy.json").read_text())
    assert resumed["restored"] is True and resumed["best"] >= best["best"]
    assert resumed["step"] == best["step"] or resumed["step"] > 600


def test_the_spelled_out_command_is_the_experiment():
    experiment = shell("python -m csframework --config-dir conf +experiment=spirals", extra=" --cfg job").stdout
    spelled_out = shell(SPELLED_OUT, extra=" --cfg job").stdout
    assert "spirals.SpiralNet" in experiment and "best_accuracy:BestAccuracy" in experiment
    assert spelled_out == experiment

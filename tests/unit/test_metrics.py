"""``csframework.builtin.metrics``: what a run directory tells a human: the model summary (logged once and in
summary.json), wall time, steps/s, peak memory and the command line in summary.json, and curves drawn only
for a fit. The command line of a CLI run: tests/e2e/test_run_summary_cli.py; the curves: test_plot.py."""
import json

import pytest
import torch
from torch import nn

import csframework as csf
import fixtures


class PartlyFrozen(nn.Module):
    """A frozen 8 -> 1000 projection (9000 parameters) under a trainable 1000 -> 4 head (4004), plus a
    buffer (counted in the size, not in the parameters)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 1000).requires_grad_(False)
        self.head = nn.Linear(1000, 4)
        self.register_buffer("scale", torch.ones(1000))

    def forward(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.frozen(x) * self.scale), y)


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_summary_json_holds_the_model_wall_time_rate_memory_and_command_line(tmp_path):
    cfg = fixtures.compose(f"model={{_target_:{__name__}.PartlyFrozen}}", "~model.net", "~model.loss",
                           "loop.max_steps=4")
    csf.Run(cfg, output_dir=tmp_path).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    model = {"parameters": 13004, "trainable_parameters": 4004, "size_mb": round((13004 + 1000) * 4 / 1e6, 3)}
    assert summary["model"] == model
    logged = [e for e in events(tmp_path) if e["event"] == "model"]
    assert len(logged) == 1 and {k: logged[0][k] for k in model} == model
    assert summary["wall_time_s"] > 0 and summary["steps_per_sec"] > 0
    wall = summary["wall_time_s"]  # rounded to the millisecond: the rate may be off by that much of it
    assert 4 / (wall + 0.0005) - 0.001 <= summary["steps_per_sec"] <= 4 / (wall - 0.0005) + 0.001
    assert summary["peak_memory"]["rss_mb"] > 10
    assert ("cuda_max_allocated_mb" in summary["peak_memory"]) == (summary["device_type"] == "GPU")
    assert isinstance(summary["command_line"], str) and summary["command_line"]


def test_on_csx_the_model_summary_has_the_compile_report_figures(tmp_path):
    csf.Run(fixtures.compose("device=csx", "loop.max_steps=2"), output_dir=tmp_path).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    report = json.loads((tmp_path / "compile_report.json").read_text())
    compiled = summary["model"]["compile"]
    assert compiled["ops"] == report["ops"]["total"] > 0
    assert compiled["memory_mb"]["parameter"] == round(report["memory"]["parameter_bytes"] / 1e6, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_peak_memory_has_cuda_max_allocated(tmp_path):
    csf.Run(fixtures.compose("device=gpu", "loop.max_steps=2"), output_dir=tmp_path).fit()
    peak = json.loads((tmp_path / "summary.json").read_text())["peak_memory"]
    assert peak["cuda_max_allocated_mb"] > 0


def test_a_validate_run_writes_its_summary_but_draws_no_curves(tmp_path):
    summary = csf.Run(fixtures.compose("mode=validate"), output_dir=tmp_path).validate()
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["val/loss"] == summary["metrics"]["val/loss"]
    assert not (tmp_path / "curves.png").exists() and not (tmp_path / "curves.svg").exists()

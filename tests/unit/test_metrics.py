"""``csframework.builtin.metrics``: what a run directory tells a human: the model summary (logged once and in
summary.json), wall time, steps/s, peak memory and the command line in summary.json, and curves drawn only
for a fit. The command line of a CLI run: tests/e2e/test_run_summary_cli.py; the curves: test_plot.py."""
import csv
import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import csframework as csf
import fixtures
from csframework.builtin.logs import WRITE_INTERVAL
from csframework.builtin.metrics import MetricsPlugin


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
    assert summary["wall_seconds"] > 0 and summary["steps_per_sec"] > 0
    assert summary["eval_seconds"] > 0 and summary["compile_seconds"] == 0
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


@pytest.mark.curves
def test_a_validate_run_writes_its_summary_but_draws_no_curves(tmp_path):
    summary = csf.Run(fixtures.compose("mode=validate"), output_dir=tmp_path).validate()
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["val/loss"] == summary["metrics"]["val/loss"]
    assert not (tmp_path / "curves.png").exists() and not (tmp_path / "curves.svg").exists()


class SlowEvaluation:
    """Every evaluation batch takes 0.3 s more (a slow validation set)."""

    name = "slow_evaluation"

    @csf.hookimpl
    def on_eval_batch_end(self):
        time.sleep(0.3)


def test_steps_per_sec_is_training_alone_in_every_log_and_in_the_summary(tmp_path):
    """Issue 39 item 5: the logs' and the summary's steps_per_sec mean the same (steps per second of training,
    evaluation and compilation left out); the summary adds wall_seconds, eval_seconds, compile_seconds."""
    cfg = fixtures.compose("loop.max_steps=6", "loop.eval_every=2", "loop.log_every=2", "loop.eval_steps=1")
    csf.Run(cfg, output_dir=tmp_path, plugins=[SlowEvaluation()]).fit()
    summary = json.loads((tmp_path / "summary.json").read_text())
    with open(tmp_path / "metrics.csv", newline="") as f:
        logged = [float(r["value"]) for r in csv.DictReader(f) if r["name"] == "steps_per_sec"]
    assert len(logged) == 3
    # each window of 2 steps followed an evaluation of >= 0.3 s, which is not in its rate
    assert min(logged) > 2 / 0.3, logged
    assert summary["eval_seconds"] >= 3 * 0.3 and summary["compile_seconds"] == 0
    assert summary["wall_seconds"] > summary["eval_seconds"]
    # the summary's rate is the logs' over the whole fit: 6 steps in the sum of the windows' training time
    assert summary["steps_per_sec"] == pytest.approx(6 / sum(2 / rate for rate in logged), rel=1e-2)
    assert summary["steps_per_sec"] > 6 / (summary["wall_seconds"] - summary["eval_seconds"])


class ThreadsSeen:
    """Records torch's intra-op thread count when training starts."""

    name = "threads_seen"

    def __init__(self):
        self.threads = None

    @csf.hookimpl
    def on_train_start(self):
        self.threads = torch.get_num_threads()


@pytest.fixture
def slow_graph_compiler(monkeypatch):
    """The CSX graph compiler takes 3 s and then gives up (the interpreted graph runs): a slow compile."""
    from csframework.graph import inductor

    def slow(*args, **kwargs):
        time.sleep(3.0)
        return None, {"status": "fallback", "seconds": 3.0, "reason": "a test's slow compiler"}

    monkeypatch.setattr(inductor, "compile_graph", slow)


@pytest.mark.slow
def test_on_csx_one_steps_per_sec_leaves_out_the_graphs_making(tmp_path, slow_graph_compiler):
    """Issue 50 item 3: on CSX the first log's rate leaves the graphs' trace and compile out, and the fit_end
    line, summary.json's metrics and its top say one steps_per_sec; ``backend.threads=null`` runs there."""
    before = torch.get_num_threads()
    seen = ThreadsSeen()
    try:
        cfg = fixtures.compose("device=csx", "backend.threads=null", f"backend.compile_dir={tmp_path / 'cache'}",
                               "backend.graph_compiler=inductor", "loop.max_steps=20", "loop.log_every=10",
                               "loop.eval_every=10", "loop.eval_steps=1")
        csf.Run(cfg, output_dir=tmp_path / "run", plugins=[seen]).fit()
    finally:
        torch.set_num_threads(before)
    assert seen.threads == before  # null keeps torch's default
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    logged = [e for e in events(tmp_path / "run") if e["event"] in ("train", "fit_end")]
    first, end = logged[0], logged[-1]
    assert summary["compile_seconds"] >= 3.0  # the train graph's compile
    assert 10 / first["steps_per_sec"] < 3.0, first  # the first 10 steps' training time, without the compile
    assert end["event"] == "fit_end" and end["steps_per_sec"] == summary["metrics"]["steps_per_sec"] \
        == summary["steps_per_sec"]


def test_backend_threads_is_honoured_on_csx(tmp_path):
    before = torch.get_num_threads()
    seen = ThreadsSeen()
    try:
        cfg = fixtures.compose("device=csx", "backend.threads=1", f"backend.compile_dir={tmp_path / 'cache'}",
                               "backend.graph_compiler=none", "loop.max_steps=1")
        csf.Run(cfg, output_dir=tmp_path / "run", plugins=[seen]).fit()
    finally:
        torch.set_num_threads(before)
    assert seen.threads == 1


def test_metrics_csv_rows_are_held_and_written_as_a_logs_lines_are(tmp_path, monkeypatch):
    """A log's rows are written at once when it comes ``WRITE_INTERVAL`` or more after the last write, else
    held and written, in order, with the next such log's or when the run ends."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    plugin = MetricsPlugin()
    plugin.file = open(tmp_path / "metrics.csv", "w", newline="", encoding="utf-8")
    plugin.writer = csv.writer(plugin.file)
    run = SimpleNamespace(stage="main", rank=1)  # (rank 1: the end closes the file, writes no summary)

    def steps():
        return [row.split(",")[0] for row in (tmp_path / "metrics.csv").read_text().splitlines()]

    plugin.on_log_metrics(run, {"train/loss": 0.5, "lr": 0.1}, 1)
    assert steps() == ["1", "1"]
    clock[0] += WRITE_INTERVAL / 2
    plugin.on_log_metrics(run, {"train/loss": 0.4, "lr": 0.1}, 2)
    assert steps() == ["1", "1"]  # held
    clock[0] += WRITE_INTERVAL
    plugin.on_log_metrics(run, {"train/loss": 0.3, "lr": 0.1}, 3)
    assert steps() == ["1", "1", "2", "2", "3", "3"]
    plugin.on_log_metrics(run, {"train/loss": 0.2, "lr": 0.1}, 4)
    plugin.on_fit_end(run)
    assert steps()[-2:] == ["4", "4"] and plugin.file is None


class RowsAtCheckpoint:
    """At each checkpoint (after the built-ins' on_checkpoint_save): the steps metrics.csv and events.jsonl
    hold then."""

    name = "rows_at_checkpoint"

    def __init__(self):
        self.seen: list[tuple[int, int, int]] = []

    @csf.hookimpl
    def on_checkpoint_save(self, run, state):
        with open(run.output_dir / "metrics.csv") as f:
            rows = max(int(r["step"]) for r in csv.DictReader(f) if r["name"] == "train/loss")
        events = fixtures.events(run.output_dir)
        logged = max(e["step"] for e in events if e["event"] == "train")
        self.seen.append((run.global_step, rows, logged))


def test_the_rows_and_lines_of_the_steps_a_checkpoint_holds_are_written_before_it(tmp_path, monkeypatch):
    """Rows and lines held by ``WRITE_INTERVAL`` waited past a checkpoint: a run killed (SIGKILL) after it
    and resumed from it never logged those steps (the resumed run starts after them)."""
    from csframework.builtin import logs, metrics

    monkeypatch.setattr(logs, "WRITE_INTERVAL", 3600.0)  # every log held but for the checkpoints
    monkeypatch.setattr(metrics, "WRITE_INTERVAL", 3600.0)
    seen = RowsAtCheckpoint()
    fixtures.fit(tmp_path, "loop.max_steps=9", "loop.log_every=1", "checkpoint.every_steps=4", "loop.eval_every=null",
                 plugins=[seen])
    assert seen.seen[:2] == [(4, 4, 4), (8, 8, 8)]


def test_a_fit_resumed_from_an_earlier_checkpoint_moves_the_rows_it_logs_again_aside(tmp_path):
    """Rows of steps after the checkpoint a fit resumes from (a run killed past it, or one resumed from an
    earlier checkpoint) would be logged twice: they move to metrics-superseded.csv, and metrics.csv ends as
    the uninterrupted run's (steps_per_sec aside, a rate)."""
    fixtures.fit(tmp_path, "loop.max_steps=8", "loop.log_every=1", "checkpoint.every_steps=4", "loop.eval_every=2")
    first = (tmp_path / "metrics.csv").read_text().splitlines()
    fixtures.fit(tmp_path, "loop.max_steps=8", "loop.log_every=1", "checkpoint.every_steps=4", "loop.eval_every=2",
                 f"checkpoint.resume={tmp_path / 'checkpoints' / 'step-00000004'}")
    again = (tmp_path / "metrics.csv").read_text().splitlines()

    def steady(lines):
        return [line for line in lines if ",steps_per_sec," not in line]

    assert steady(again) == steady(first) and len(again) == len(first)
    later = [line for line in first[1:] if int(line.split(",")[0]) > 4]
    assert later and (tmp_path / "metrics-superseded.csv").read_text().splitlines() == [first[0], *later]
    moved = next(e for e in fixtures.events(tmp_path) if e["event"] == "metrics_rows_superseded")
    assert moved["rows"] == len(later) and moved["after_step"] == 4


def test_superseding_rows_reads_metrics_csv_as_untrusted_and_loses_nothing(tmp_path):
    """Only whole rows of a later step move, in order, appended after the header or earlier moves (a last line
    there left unended is ended first, not glued to); the header, an overlong line, garbage, non-UTF-8 bytes
    and rows of earlier steps stay; a moved row cut short is ended; with nothing to move, neither file is
    touched."""
    from csframework.builtin.metrics import _PIECE, supersede_rows_after
    from csframework.files import SafeDir

    long_row = b"9,main," + b"x" * (2 * _PIECE) + b",1.0\r\n"  # a row of step 9, but too long to be one
    lines = [b"step,stage,name,value\r\n", b"3,main,train/loss,1.5\r\n", b"5,main,train/loss,\xff\xfe\r\n",
             b"garbage\r\n", long_row, b"12x,main,a,1\r\n", b"4,main,val/loss,2\r\n", b"6,main,lr,0.1"]
    (tmp_path / "metrics.csv").write_bytes(b"".join(lines))
    (tmp_path / "metrics-superseded.csv").write_bytes(b"step,stage,name,value\r\n7,main,lr,1")  # left unended
    files = SafeDir(tmp_path)
    assert supersede_rows_after(files, 6) == 0
    assert (tmp_path / "metrics.csv").read_bytes() == b"".join(lines)
    assert not (tmp_path / "metrics-superseded.csv").read_bytes().endswith(b"\n")
    assert supersede_rows_after(files, 4) == 2
    assert (tmp_path / "metrics.csv").read_bytes() == b"".join(
        [lines[0], lines[1], lines[3], long_row, lines[5], lines[6]])
    assert (tmp_path / "metrics-superseded.csv").read_bytes() == (
        b"step,stage,name,value\r\n7,main,lr,1\n5,main,train/loss,\xff\xfe\r\n6,main,lr,0.1\r\n")
    (tmp_path / "metrics.csv").unlink()
    (tmp_path / "metrics.csv").symlink_to(tmp_path / "metrics-superseded.csv")  # never followed
    assert supersede_rows_after(files, 0) == 0


def test_a_refused_resume_keeps_the_summary_and_a_validate_after_a_resumed_fit_moves_nothing(tmp_path):
    """A planted metrics-superseded.csv (a link) refuses the resume before it begins: the finished run's
    summary.json stays. A ``validate`` after a resumed ``fit`` in the same ``Run`` moves none of the rows that
    fit logged."""
    overrides = ["loop.max_steps=6", "loop.log_every=1", "checkpoint.every_steps=2"]
    fixtures.fit(tmp_path, *overrides)
    summary = (tmp_path / "summary.json").read_bytes()
    (tmp_path / "metrics-superseded.csv").symlink_to(tmp_path / "elsewhere.csv")
    resume = f"checkpoint.resume={tmp_path / 'checkpoints' / 'step-00000004'}"
    with pytest.raises(csf.CsfError, match="metrics-superseded.csv: cannot open it"):
        fixtures.fit(tmp_path, *overrides, resume)
    assert (tmp_path / "summary.json").read_bytes() == summary and not (tmp_path / "elsewhere.csv").exists()
    (tmp_path / "metrics-superseded.csv").unlink()
    run = csf.Run(fixtures.compose(*overrides, resume), output_dir=tmp_path)
    run.fit()
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    run.validate()
    assert (tmp_path / "metrics.csv").read_text().splitlines()[:len(rows)] == rows
    assert [e["event"] for e in fixtures.events(tmp_path)].count("metrics_rows_superseded") == 1

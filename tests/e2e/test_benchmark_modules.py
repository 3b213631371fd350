"""The memory, evaluation, checkpoint I/O and GPU benchmarks keep working: each module's ``figures()`` runs its
fresh-process contestants on a small workload and returns complete figures (their values are the report's,
not asserted here)."""
import pytest

from benchmarks import __main__ as bench_main
from benchmarks import checkpoint_io, evaluation, gpu, harness, memory_growth

pytestmark = pytest.mark.slow


def check(figure: harness.Figure, module: str, baseline: bool) -> None:
    assert figure.name and figure.unit and figure.target and figure.limit is not None
    assert len(figure.samples) == 1 and all(s == s for s in figure.samples)  # one round, no NaN
    assert bool(figure.baseline_samples) == baseline and len(figure.baseline_samples) == (1 if baseline else 0)
    assert figure.command.startswith(f"python -m benchmarks.{module} ")
    assert figure.met in (True, False)
    assert figure.name in harness.table([figure])


def test_memory_growth_figure():
    [figure] = memory_growth.figures(1, steps=1500)  # warm point 1000, evaluations and checkpoints at 1000, 1500
    check(figure, "memory_growth", baseline=False)
    assert figure.kind == "value" and figure.unit == "MB" and figure.limit == 5.0
    assert "--steps 1500" in figure.command


def test_evaluation_figure_and_both_sides_compute_the_same_loss():
    results = evaluation.measure(1, passes=1)
    assert results["hand"][0]["loss"] == pytest.approx(results["csframework"][0]["loss"], rel=1e-6)
    assert results["hand"][0]["batches"] == results["csframework"][0]["batches"] == 128
    [figure] = evaluation.figures(1, passes=1, results=results)
    check(figure, "evaluation", baseline=True)
    assert figure.kind == "ratio" and figure.limit == 1.02


def test_checkpoint_io_figures(tmp_path):
    results = checkpoint_io.measure(1, params=200_000, repeats=1, directory=str(tmp_path))
    save, load = checkpoint_io.figures(1, params=200_000, repeats=1, results=results)
    for figure in (save, load):
        check(figure, "checkpoint_io", baseline=True)
        assert figure.limit == 1.5
    assert save.name.startswith("checkpoint save") and load.name.startswith("checkpoint load")
    assert list(tmp_path.iterdir()) == []  # every contestant removed its files


def test_gpu_figures_checked_on_the_cpu(monkeypatch):
    """``benchmarks.gpu`` with ``CSF_BENCH_DEVICE=cpu`` (its contestants inherit it): both sides train the same
    run (``figures`` raises if their losses differ) and the figures are complete."""
    monkeypatch.setenv("CSF_BENCH_DEVICE", "cpu")
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    [figure] = gpu.figures(1, steps=20, only="mlp2")
    check(figure, "gpu", baseline=True)
    assert figure.limit == 1.05 and "on CPU (CSF_BENCH_DEVICE=cpu)" in figure.name


def test_table_sections_are_written_apart(tmp_path, monkeypatch):
    """The GPU table has a section of its own: a CPU-only run rewrites the CPU table and leaves it."""
    page = tmp_path / bench_main.TABLES_PAGE
    page.parent.mkdir(parents=True)
    page.write_text("a\n<!-- benchmarks:start -->\nold cpu\n<!-- benchmarks:end -->\nb\n"
                    "<!-- benchmarks-gpu:start -->\nold gpu\n<!-- benchmarks-gpu:end -->\n")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    bench_main.write_table("benchmarks", "new cpu")
    assert page.read_text() == ("a\n<!-- benchmarks:start -->\nnew cpu\n<!-- benchmarks:end -->\n"
                                "b\n<!-- benchmarks-gpu:start -->\nold gpu\n<!-- benchmarks-gpu:end -->\n")
    with pytest.raises(SystemExit, match="benchmarks-tpu:start"):
        bench_main.write_table("benchmarks-tpu", "x")


def test_the_tables_page_has_both_sections():
    """``--write`` finds its markers in the page the docs site shows."""
    text = (harness.ROOT / bench_main.TABLES_PAGE).read_text()
    for section in ("benchmarks", "benchmarks-gpu"):
        assert f"<!-- {section}:start -->" in text and f"<!-- {section}:end -->" in text


def test_compile_time_runs_the_nanogpt_shaped_model_and_checks_the_targets(monkeypatch):
    """benchmarks/compile_time.py: its eager contestant trains examples/char_gpt's model (the compiled ones are
    the same run with backend.compile=true: minutes cold); the report checks the issue's targets."""
    from benchmarks import compile_time

    monkeypatch.syspath_prepend(str(harness.ROOT / "examples" / "char_gpt"))
    eager = compile_time.contestant("gpt-1", compiled=False)
    assert eager["compile_s"] == 0.0 and eager["s_per_step"] > 0
    rows = [{"model": m, "cold_s": c, "cached_s": 1.0, "step_ratio": 0.9, "graph": "per function",
             "regions": "12 x Block" if m == "gpt-12" else "", "cached_hit": "hit"}
            for m, c in (("default", 20.0), ("gpt-1", 10.0), ("gpt-12", 12.0))]
    text = compile_time.report(rows)
    assert "| gpt-12 | per function (12 x Block compiled once) | 12.0 | 1.0 | 0.90x |" in text
    assert "12 layers' cold compile / 1 layer's: 1.20x (target <= 1.5x)" in text
    assert "default transformer: cold 20.0 s (target <= 30 s), cached 1.0 s (target <= 3 s)" in text


def test_csx_headline_figures():
    """``benchmarks.csx_headline``: each contestant runs the whole command (3 steps, a cold compile directory);
    the five figures of issue 48 are complete, and every csx run reports the seconds the figures are made of."""
    from benchmarks import csx_headline

    results = csx_headline.measure(1, steps=3)
    assert all(rows[0]["steps"] == 3 for rows in results.values())
    retrace = results["csx-retrace"][0]
    assert retrace["traces"] == 3 and retrace["graph_compiler"] == "interpreted"
    assert 0 < retrace["first_trace_s"] <= retrace["trace_seconds"] and retrace["train_seconds"] > 0
    figures = csx_headline.figures(1, steps=3, results=results)
    assert len(figures) == 5
    for figure in figures:
        check(figure, "csx_headline", baseline=figure.kind == "ratio")


@pytest.mark.parametrize("retrace", [False, True], ids=["interpreted", "retrace"])
def test_csx_own_time_measures_a_step_against_its_graph_alone(retrace):
    """``benchmarks.csx_emulator --own-time`` (issue 52): one process steps the blobs MLP on ``device=csx`` and
    runs the same graph alone; a step is the graph's operations and the emulator's own work."""
    from benchmarks import csx_emulator

    result = csx_emulator.own_time(retrace, steps=30)
    assert result["contestant"] == ("own-retrace" if retrace else "own") and result["graph_ops"] > 50
    assert 0 < result["graph_ops_us"] < result["step_us"]
    assert result["own_us_per_step"] == pytest.approx(result["step_us"] - result["graph_ops_us"])
    assert result["own_us_quietest"] > 0


def test_csx_opcodes_count_the_emulators_own_work_a_step(capsys):
    """``benchmarks.csx_emulator --opcodes``: a step's bytecodes less the graph's alone; the emulator's own
    frames count, the graph's generated code cancels out."""
    from benchmarks import csx_emulator

    counts = csx_emulator.own_opcodes(5, steps=10)
    own = counts["opcodes"]
    assert sum(own.values()) > 0
    assert own[next(name for name in own if name.startswith("execution.py:") and name.endswith(":__call__"))] > 0
    assert not any(abs(n) > 0 for name, n in own.items() if name.startswith("_ops.py:"))
    out = capsys.readouterr().out
    assert "opcodes per step" in out and "c_calls per step" in out

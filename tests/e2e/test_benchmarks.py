"""The benchmarks keep working: each module's ``figures()`` runs its fresh-process contestants on a small
workload and returns complete figures (the values themselves are the report's, never asserted here)."""
import pytest

from benchmarks import data_fetch, harness, loop_overhead

pytestmark = pytest.mark.slow


def test_loop_overhead_figures_compare_the_same_training():
    """Both sides train the same numbers (``figures`` raises if their last logged losses differ)."""
    [tiny] = loop_overhead.figures(1, only="tiny-premade", steps=60)
    [same_loader] = loop_overhead.figures(1, only="mlp2-loader", steps=30)
    [hook] = loop_overhead.figures(1, only="user-hook", steps=60)
    [own, own_index] = loop_overhead.figures(1, only="own-time", steps=60)
    for figure in (tiny, same_loader, hook, own, own_index):
        assert len(figure.samples) == len(figure.baseline_samples) == 1 and figure.met in (True, False, None)
        assert figure.name in harness.table([figure])
    assert tiny.limit == 1.10 and same_loader.limit == 1.01 and hook.kind == "difference" and hook.limit == 5
    assert own.kind == "difference" and own.limit == 20 and own.target == "<= +20 us"
    assert own.samples[0] > 0 and own.baseline_samples[0] > 0
    # the second row: the same framework runs against a hand loop that reads its batches as it goes (no target)
    assert own_index.samples == own.samples and own_index.limit is None and own_index.kind == "difference"
    assert own_index.baseline_samples[0] > 0
    # a loop that reads its batches: against the hand loop that does, and that loop against pre-made batches
    [index, read] = loop_overhead.figures(1, only="mlp-index", steps=20)
    assert index.limit is None and read.limit is None and read.samples == index.baseline_samples
    assert read.baseline == "hand loop, pre-made batches" and read.baseline_samples[0] > 0


@pytest.mark.parametrize("side", ["hand", "framework"])
def test_the_loops_own_time_is_part_of_its_step(side):
    """``--own-time``: the step less the model's forward, backward and optimizer calls, timed alike."""
    result = harness.run_once(loop_overhead.command("--contestant", side, "--model", "tiny", "--steps", "40",
                                                    "--own-time"), timeout=300)
    assert 0 < result["own_us_per_step"] < result["us_per_step"] / 2  # the tiny model's calls are most of a step


def test_data_fetch_figure():
    [figure] = data_fetch.figures(1)
    assert figure.samples[0] > 0 and figure.baseline_samples[0] > 0 and figure.unit == "CPU us/batch"


@pytest.mark.parametrize("side", ["csframework", "hand", "hydra"])
def test_startup_contestants_report_their_first_step(side):
    """benchmarks/startup.py: each contestant's child reaches its first step (the FirstStep plugin inside
    ``python -m csframework``, the stamp of the hand-written script) and the times are in order."""
    result = harness.run_once(harness.python("benchmarks.startup", "--contestant", f"{side}-mlp"), timeout=300)
    assert 0 < result["first_step_cpu_s"] and 0 < result["first_step_s"] <= result["run_s"]


def test_contestants_load_the_project_from_cached_bytecode(monkeypatch):
    """``harness.interleaved`` compiles the project first: a fresh contestant loads csframework's modules as a
    user's Python does from its second run on, even where ``PYTHONDONTWRITEBYTECODE`` keeps it from writing
    them itself (it would otherwise compile every module in every process)."""
    import importlib.util

    cached = importlib.util.cache_from_source(str(harness.ROOT / "csframework" / "run.py"))
    monkeypatch.setattr(harness, "run_once", lambda command, env=None: {"ok": 1})
    if harness.Path(cached).exists():
        harness.Path(cached).unlink()
    assert harness.interleaved({"a": ["true"]}, 1) == {"a": [{"ok": 1}]}
    assert harness.Path(cached).exists()


def test_the_table_header_names_what_changes_start_up():
    """The packages beside csframework's own install that change its start-up (Hydra's plugins, rich) are
    named in the table's header."""
    from importlib.metadata import distributions

    from benchmarks.__main__ import header

    installed = {d.metadata["Name"].lower() for d in distributions()}
    info = harness.machine()
    assert set(info["beside_core"]) <= installed and "hydra-core" not in info["beside_core"]
    assert ("rich" in info["beside_core"]) == ("rich" in installed)
    text = header(info, 1, 60.0, gpu=False)
    assert all(name in text for name in info["beside_core"]) or "no Hydra plugin or rich installed" in text


def test_the_table_shows_how_far_a_round_strays():
    """The ratio column: the median of the per-round ratios, then their min-max (a figure whose rounds
    straddle the target is read as such); a difference likewise; an absolute value has neither."""
    ratio = harness.Figure(name="r", unit="us/step", samples=[110.0, 95.0, 104.0], baseline="hand",
                           baseline_samples=[100.0, 100.0, 100.0], target="<= 1.05x", limit=1.05)
    difference = harness.Figure(name="d", unit="s", samples=[2.3, 2.1], baseline="hand", baseline_samples=[2.0, 2.0],
                                kind="difference", target="<= +0.2 s", limit=0.2)
    value = harness.Figure(name="v", unit="MB", samples=[0.8, 0.9], kind="value", target="< 5 MB", limit=5)
    rows = harness.table([ratio, difference, value]).splitlines()[2:]
    assert "| 1.040x [0.950-1.100] | <= 1.05x | yes |" in rows[0]
    assert "| +0.2 s [+0.1 to +0.3] |" in rows[1] and rows[2].endswith("| - | < 5 MB | yes |")
    assert ratio.row()["per_round"] == pytest.approx([1.1, 0.95, 1.04]) and value.row()["per_round"] == []


def test_compiled_rows_compare_the_same_training_and_report_the_compile_time():
    """``backend.compile=true`` beside the hand loop (losses within 10%: compiled kernels round differently),
    with its compile time cold and from Inductor's cache."""
    step, cached, cold = loop_overhead.figures(1, only="compiled-tiny32", steps=60)
    assert step.limit == 0.7 and len(step.samples) == len(step.baseline_samples) == 1 and step.met in (True, False)
    assert cached.kind == cold.kind == "value" and cached.samples[0] > 0 and cold.samples[0] > 0
    assert cached.limit == 2.0 and "compile" in harness.table([step, cached, cold])

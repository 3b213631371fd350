"""Hostile run directories (issue 27): a link, hard link, FIFO, directory-for-a-file, file-for-a-directory,
predictable temporary name, forged or oversized file planted at a path a run writes or reads. For each
attack: ``python -m csframework`` (a tiny CPU run, a checkpoint every step so pruning runs) ends within a
bounded time, either completes or exits 1/2 with one ``csframework: error:`` line naming the planted path,
never with a traceback; and everything outside the run directory (a victim tree of known files, another
run, the working directory) is byte-identical afterwards, nothing created or removed there.

``FRESH`` attacks plant into an empty run directory before a new run; ``RESUMED`` ones into a copy of a
completed run (checkpoints at steps 1, 2, 3) resumed with ``checkpoint.resume=auto`` and ``keep_last=1``;
``PREDICTED`` ones are planted from inside the run (``hostile.Planter``) at the temporary names a framework
deriving them from its pid would use. The helper: tests/support/hostile.py.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import csframework as csf
import fixtures
import hostile
from fixtures import CONF
from csframework.rundir import RUN_RECORDS
from hostile import Hostile, assert_outcome

pytestmark = pytest.mark.slow

BASE = ["--config-dir", CONF, "model=blobs_mlp", "data=blobs", "optimizer=sgd", "optimizer.lr=0.1",
        "loop.eval_every=null", "loop.eval_steps=null", "loop.log_every=1", "backend.threads=1"]
FRESH_RUN = [*BASE, "loop.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=2"]
RESUME_RUN = [*BASE, "loop.max_steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
              "checkpoint.resume=auto"]
COLLECT = ["loop.collect=[preds,labels]", "loop.collect_save=true"]
SPILL = [*COLLECT, "loop.collect_max_memory_mb=0.0001"]  # every evaluation batch spills to disk
PLANTER = ["plugins.enable=[hostile:Planter]"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A completed run (checkpoints at steps 1, 2, 3) and another run (steps 2, 4) beside it."""
    base = tmp_path_factory.mktemp("hostile-template")
    csf.Run(fixtures.compose("loop.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=3"),
            output_dir=base / "run").fit()
    csf.Run(fixtures.compose("loop.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5"),
            output_dir=base / "other").fit()
    return base


class Area:
    """``tmp_path/area``: the victim tree, ``other`` (a completed run not under attack) and ``run``."""

    def __init__(self, template: Path, tmp_path: Path, resumed: bool):
        self.root = tmp_path / "area"
        self.root.mkdir()
        shutil.copytree(template / "other", self.root / "other", symlinks=True)
        self.other = self.root / "other"
        self.run = self.root / "run"
        if resumed:
            shutil.copytree(template / "run", self.run, symlinks=True)
        else:
            self.run.mkdir()
        self.h = Hostile(self.root)

    def cli(self, env: dict, *args: str, timeout: float = hostile.RUN_TIMEOUT) -> hostile.Outcome:
        return self.h.cli([*args, f"hydra.run.dir={self.run}"], env, timeout)


@pytest.fixture
def fresh(template, tmp_path):
    return Area(template, tmp_path, resumed=False)


@pytest.fixture
def resumed(template, tmp_path):
    return Area(template, tmp_path, resumed=True)


def run_events(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "events.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def assert_completed_if_it_succeeded(out: hostile.Outcome, run_dir: Path, step: int) -> None:
    """Exit 0 is success only if the run completed: its own ``summary.json`` (a regular file, strict JSON)
    says ``completed`` at ``step``."""
    if out.returncode != 0:
        return
    path = run_dir / "summary.json"
    assert path.is_file() and not path.is_symlink(), f"exit 0 but {path} is not the run's own file"
    summary = hostile.strict_json(path.read_text())
    assert (summary["status"], summary["global_step"]) == ("completed", step), summary


# -- a new run over planted paths ----------------------------------------------------------------------------
# (relative path, kind, extra overrides)
FRESH = [
    ("events.jsonl", "symlink-file", ()),
    ("events.jsonl", "dangling", ()),
    ("events.jsonl", "hardlink", ()),
    ("events.jsonl", "fifo", ()),
    ("events.jsonl", "dir", ()),
    ("metrics.csv", "symlink-file", ()),
    ("metrics.csv", "dangling", ()),
    ("metrics.csv", "hardlink", ()),
    ("metrics.csv", "fifo", ()),
    ("summary.json", "symlink-file", ()),
    ("summary.json", "dangling", ()),
    ("summary.json", "hardlink", ()),
    ("summary.json", "fifo", ()),
    ("summary.json", "dir", ()),
    (".hydra", "symlink-dir", ()),
    (".hydra", "dangling", ()),
    (".hydra", "file", ()),
    (".hydra/config.yaml", "symlink-file", ()),
    (".hydra/config.yaml", "hardlink", ()),
    (".hydra/hydra.yaml", "symlink-file", ()),
    (".hydra/overrides.yaml", "symlink-file", ()),
    (".hydra/overrides.yaml", "dangling", ()),
    ("curves.png", "symlink-file", ()),
    ("curves.png", "dangling", ()),
    ("curves.png", "hardlink", ()),
    ("curves.svg", "symlink-file", ()),
    ("checkpoints", "symlink-dir", ()),
    ("checkpoints", "dangling", ()),
    ("checkpoints", "file", ()),
    ("checkpoints/index.json", "symlink-file", ()),
    ("checkpoints/index.json", "hardlink", ()),
    ("checkpoints/step-00000001", "symlink-dir", ()),
    ("eval_outputs", "symlink-dir", COLLECT),
    ("eval_outputs", "dangling", COLLECT),
    ("eval_outputs", "file", COLLECT),
    ("eval_outputs/step_3.safetensors", "symlink-file", COLLECT),
    (".csframework.lock", "symlink-file", ()),
    (".csframework.lock", "dangling", ()),
    (".csframework.lock", "hardlink", ()),
    (".csframework.lock", "fifo", ()),
    (".csframework.lock", "dir", ()),
]


@pytest.mark.parametrize("where, kind, extra", FRESH, ids=[f"{w}-{k}" for w, k, _ in FRESH])
def test_a_new_run_over_a_planted_path(fresh, cli_env, where, kind, extra):
    planted = fresh.h.plant(fresh.run / where, kind)
    fresh.h.guard(fresh.run)
    out = fresh.cli(cli_env, *FRESH_RUN, *extra)
    # a record of a run (a regular file, a checkpoints/ directory with an entry): refused before anything is
    # written (issue 39); a link or a FIFO in its place is no run's and is refused by the file layer as before
    if where.startswith("checkpoints/") or (where in RUN_RECORDS and kind == "hardlink"):
        lines = hostile.error_lines(out.stderr)
        assert out.returncode == 2 and len(lines) == 1 and f"run directory {fresh.run} holds a run" in lines[0], str(out)
        hostile.assert_bounded(out)
    else:
        assert_outcome(out, planted)
    fresh.h.assert_untouched()
    assert_completed_if_it_succeeded(out, fresh.run, 3)


@pytest.mark.parametrize("below", [False, True], ids=["the-file", "below-the-file"])
def test_a_run_directory_that_is_a_file(fresh, cli_env, below):
    """``hydra.run.dir`` names a regular file (someone else's), or a directory below one (before, issue 37: a
    ``NotADirectoryError`` traceback): one line naming it, the file untouched."""
    path = fresh.h.plant(fresh.root / "not-a-directory", "forged", content=b"someone else's file\n")
    fresh.h.guard()  # nothing is the run's: the file it was pointed at is not its own either
    out = fresh.h.cli([*FRESH_RUN, f"hydra.run.dir={path / 'sub' if below else path}"], cli_env)
    assert_outcome(out, path, allow_success=False)
    fresh.h.assert_untouched()


# -- predictable temporary names, planted from inside the run with the run's own pid --------------------------
PREDICTED = [
    (".curves.png.{pid}.tmp", "symlink-file", ()),
    (".curves.png.{pid}.tmp", "dangling", ()),
    (".curves.svg.{pid}.tmp", "symlink-file", ()),
    ("summary.json.tmp-{pid}", "symlink-file", ()),
    ("summary.json.tmp-{pid}", "fifo", ()),
    ("checkpoints/index.json.tmp-{pid}", "symlink-file", ()),
    ("checkpoints/.tmp-step-00000002-{pid}", "symlink-dir", ()),
    (".collect-rank0-{pid}", "symlink-dir", SPILL),
    (".collect-rank0-{pid}", "file", SPILL),
    ("eval_outputs/.step_3.safetensors.{pid}.tmp", "symlink-file", COLLECT),
]


@pytest.mark.parametrize("where, kind, extra", PREDICTED, ids=[f"{w}-{k}" for w, k, _ in PREDICTED])
def test_a_predictable_temporary_name_planted_while_the_run_starts(fresh, cli_env, where, kind, extra):
    fresh.h.guard(fresh.run)
    env = dict(cli_env, **hostile.planter_env(fresh.h.victim, (where, kind)))
    out = fresh.cli(env, *FRESH_RUN, *PLANTER, *extra)
    # the pid is the run's: an error may name the planted file by its fixed part
    assert_outcome(out, fresh.run / where.split("{pid}")[0])
    fresh.h.assert_untouched()
    assert_completed_if_it_succeeded(out, fresh.run, 3)


def test_the_planter_plants_with_the_runs_pid(fresh, cli_env):
    """The predicted names are real: the planter puts its link where a pid-named file would go."""
    env = dict(cli_env, **hostile.planter_env(fresh.h.victim, ("planted-{pid}.lnk", "symlink-file")))
    out = fresh.cli(env, *FRESH_RUN, *PLANTER)
    assert out.returncode == 0, str(out)
    links = list(fresh.run.glob("planted-*.lnk"))
    assert len(links) == 1 and re.fullmatch(r"planted-\d+\.lnk", links[0].name) and links[0].is_symlink()


# -- a resumed run over planted paths ------------------------------------------------------------------------
RESUMED = [
    ("events.jsonl", "symlink-file"),
    ("events.jsonl", "hardlink"),
    ("events.jsonl", "fifo"),
    ("metrics.csv", "symlink-file"),
    ("metrics.csv", "hardlink"),
    ("metrics.csv", "fifo"),
    ("summary.json", "fifo"),
    (".csframework.lock", "hardlink"),
    ("checkpoints/index.json", "fifo"),
    ("checkpoints/index.json", "oversized"),
    ("checkpoints/index.json", "deep"),
    ("checkpoints/step-00000003/meta.json", "oversized"),
    ("checkpoints/step-00000003/meta.json", "fifo"),
    ("checkpoints/step-00000003/config.yaml", "oversized"),
    ("checkpoints/step-00000003/state.pt", "fifo"),
]


@pytest.mark.parametrize("where, kind", RESUMED, ids=[f"{w}-{k}" for w, k in RESUMED])
def test_resuming_over_a_planted_path(resumed, cli_env, where, kind):
    if kind == "deep":
        planted = resumed.h.plant(resumed.run / where, "forged", content=hostile.deep_json())
    elif kind == "oversized":
        planted = resumed.h.plant(resumed.run / where, "oversized", content=b'{"checkpoints": ["step-0000000')
    else:
        planted = resumed.h.plant(resumed.run / where, kind)
    resumed.h.guard(resumed.run)
    out = resumed.cli(cli_env, *RESUME_RUN)
    assert_outcome(out, planted)
    resumed.h.assert_untouched()
    assert_completed_if_it_succeeded(out, resumed.run, 5)


def test_checkpoints_linked_to_another_runs_are_neither_resumed_nor_pruned(resumed, cli_env):
    """``checkpoints`` -> the other run's ``checkpoints``: ``resume=auto`` must not continue that run, and
    ``keep_last=1`` must not delete its checkpoints (the issue: it did both)."""
    shutil.rmtree(resumed.run / "checkpoints")
    planted = resumed.h.plant(resumed.run / "checkpoints", "symlink-dir", target=resumed.other / "checkpoints")
    resumed.h.guard(resumed.run)
    out = resumed.cli(cli_env, *RESUME_RUN)
    assert_outcome(out, planted)
    resumed.h.assert_untouched()  # the other run, its checkpoints and index included
    other = str(resumed.other)
    assert not [e for e in run_events(resumed.run) if e.get("event") == "resumed" and other in str(e.get("path"))]


@pytest.mark.parametrize("kind", ["symlink-file", "hardlink"])
def test_an_index_linked_to_another_runs_index_is_not_rewritten(resumed, cli_env, kind):
    planted = resumed.h.plant(resumed.run / "checkpoints" / "index.json", kind,
                              target=resumed.other / "checkpoints" / "index.json")
    resumed.h.guard(resumed.run)
    out = resumed.cli(cli_env, *RESUME_RUN)
    assert_outcome(out, planted)
    resumed.h.assert_untouched()
    assert_completed_if_it_succeeded(out, resumed.run, 5)


def test_a_checkpoint_that_links_to_another_runs_is_neither_resumed_nor_pruned(resumed, cli_env):
    planted = resumed.h.plant(resumed.run / "checkpoints" / "step-00000003", "symlink-dir",
                              target=resumed.other / "checkpoints" / "step-00000004")
    resumed.h.guard(resumed.run)
    out = resumed.cli(cli_env, *RESUME_RUN)
    assert_outcome(out, planted)
    resumed.h.assert_untouched()
    assert_completed_if_it_succeeded(out, resumed.run, 5)
    assert not [e for e in run_events(resumed.run)
                if e.get("event") == "resumed" and str(resumed.other) in str(e.get("path"))]


# -- a run that cannot read what it wrote --------------------------------------------------------------------
def test_a_config_over_the_read_limit_is_refused_before_training(fresh, cli_env):
    """A plugin section whose default makes the config bigger than a checkpoint's config may be (16 MiB):
    every checkpoint would be unreadable on resume, so the run is refused before it trains (exit 2) naming
    the limit and the key."""
    fresh.h.guard(fresh.run)
    out = fresh.cli(cli_env, *FRESH_RUN, "plugins.enable=[hostile:BigSection]", timeout=180)
    hostile.assert_bounded(out)
    assert out.returncode == 2, str(out)
    lines = hostile.error_lines(out.stderr)
    assert len(lines) == 1, str(out)
    # the key: the section (or the field in it) that makes the config too big; the limit: 16 MiB
    assert "bigsection" in lines[0] and re.search(r"16 ?MiB|16777216", lines[0]), lines[0]
    assert not list(fresh.run.glob("checkpoints/step-*")), "trained although the config cannot be read back"
    fresh.h.assert_untouched()


def _damage_every_checkpoint(area: Area, how: str) -> list[Path]:
    steps = sorted((area.run / "checkpoints").glob("step-*"))
    assert [p.name for p in steps] == ["step-00000001", "step-00000002", "step-00000003"]
    for step in steps:
        if how == "config-over-the-limit":
            hostile.plant(step / "config.yaml", "oversized", area.h.victim, content=b"model:\n  x: ",
                          size=hostile.CONFIG_LIMIT + 1)
        else:  # truncated state
            data = (step / "state.pt").read_bytes()
            (step / "state.pt").write_bytes(data[: len(data) // 2])
    return steps


@pytest.mark.parametrize("how", ["config-over-the-limit", "state-truncated"])
def test_resume_auto_over_checkpoints_it_cannot_read_stops_naming_them(resumed, cli_env, how):
    """``resume=auto`` found checkpoints and could read none: exit 2 naming them and how to start fresh,
    never a start from step 0 that prunes them (the issue: it did)."""
    _damage_every_checkpoint(resumed, how)
    kept = hostile.snapshot(resumed.run / "checkpoints")
    resumed.h.guard(resumed.run)
    out = resumed.cli(cli_env, *RESUME_RUN)
    hostile.assert_bounded(out)
    assert out.returncode == 2, str(out)
    lines = hostile.error_lines(out.stderr)
    assert len(lines) == 1, str(out)
    assert str(resumed.run / "checkpoints") in lines[0] and "checkpoint.start_over=true" in lines[0], str(out)
    assert hostile.snapshot(resumed.run / "checkpoints") == kept, "the unreadable checkpoints were changed"
    # exit 2: nothing trained and nothing written; the old run's summary (completed at step 3) is not lost
    summary = json.loads((resumed.run / "summary.json").read_text())
    assert (summary["status"], summary["global_step"]) == ("completed", 3), \
        f"summary.json of the refused run replaced the completed run's: {summary}"
    resumed.h.assert_untouched()


def test_start_over_when_checkpoints_cannot_be_moved_leaves_the_old_run_whole(resumed, cli_env):
    """``checkpoint.start_over=true`` with a read-only ``checkpoints/`` (issue 47 item 5: it moved the other
    entries into ``previous-runs/`` and failed with a ``PermissionError`` traceback): exit 2, one line naming
    the entry and the fix, nothing moved; the modes decide, so this holds when the tests run as root too."""
    (resumed.run / "checkpoints").chmod(0o555)
    try:
        lock = [resumed.run / ".csframework.lock"]  # its holder record is rewritten by every run
        kept = hostile.snapshot(resumed.run, lock)
        resumed.h.guard(resumed.run)
        out = resumed.cli(cli_env, *FRESH_RUN, "checkpoint.start_over=true")
        hostile.assert_bounded(out)
        lines = hostile.error_lines(out.stderr)
        assert out.returncode == 2 and len(lines) == 1, str(out)
        assert (f"cannot move checkpoints of run directory {resumed.run} into previous-runs/" in lines[0]
                and "nothing was moved" in lines[0] and f"chmod u+w {resumed.run / 'checkpoints'}" in lines[0]), str(out)
        assert hostile.snapshot(resumed.run, lock) == kept
        resumed.h.assert_untouched()
    finally:
        (resumed.run / "checkpoints").chmod(0o755)

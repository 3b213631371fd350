"""The fresh-run rule at every way into a run, and ``checkpoint.start_over``'s all-or-nothing move (issue 47
items 3 to 6): nothing of a run a directory holds is written over, by a ``validate`` before a ``fit``, by a
checkpoint of another run (one under ``previous-runs/`` there), or by a start over that cannot move it all; a
directory holding only an earlier run's ``events.jsonl`` holds a run."""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

import csframework as csf
from csframework import previous_runs
from csframework.errors import RunDirHoldsRun
from csframework.files import SafeDir
from csframework.previous_runs import PREVIOUS_RUNS
from csframework.rundir import LOCK_NAME

import fixtures

ROOT = Path(__file__).resolve().parents[2]
CFG = ["loop.max_steps=2", "loop.eval_every=null", "checkpoint.every_steps=1", "checkpoint.keep_last=5"]


def snapshot(run_dir: Path) -> dict[str, bytes | str]:
    """Every entry below ``run_dir`` (the lock aside): a file's bytes, a directory's mode, a link's target."""
    found: dict[str, bytes | str] = {}
    for path in sorted(run_dir.rglob("*")):
        name = str(path.relative_to(run_dir))
        if name == LOCK_NAME:
            continue
        found[name] = (f"-> {os.readlink(path)}" if path.is_symlink() else
                       f"dir {path.stat().st_mode:o}" if path.is_dir() else path.read_bytes())
    return found


@pytest.fixture
def finished(tmp_path) -> Path:
    """A finished run (checkpoints at steps 1 and 2, summary.json, metrics.csv, events.jsonl)."""
    csf.Run(fixtures.compose(*CFG), output_dir=tmp_path).fit()
    return tmp_path


def test_a_validate_before_fit_is_refused_over_a_finished_run_as_fit_alone_is(finished):  # item 3
    before = snapshot(finished)
    run = csf.Run(fixtures.compose(*CFG), output_dir=finished)
    with pytest.raises(RunDirHoldsRun, match=re.escape(f"run directory {finished} holds a run (checkpoints, "
                                                       "summary.json, metrics.csv, events.jsonl)")) as refused:
        run.validate()
    assert refused.value.exit_code == 2
    with pytest.raises(RunDirHoldsRun):
        run.fit()
    assert snapshot(finished) == before
    # the run a directory holds is still evaluated there (resume=auto), and a fit of that Run goes on with it
    resumed = csf.Run(fixtures.compose(*CFG, "checkpoint.resume=auto"), output_dir=finished)
    assert resumed.validate()["global_step"] == 2 and resumed.fit()["status"] == "completed"


def test_an_evaluation_in_a_trained_run_s_directory_keeps_the_training_s_summary(finished):
    """``mode=validate`` (or ``test``, ``predict``) with ``resume=auto`` in the directory of the run it evaluates
    wrote its summary over the training's (its timings, test results, command line lost); it now goes to
    ``summary-<mode>.json`` beside it. In a directory of its own it is ``summary.json``, as before."""
    import json

    trained = (finished / "summary.json").read_bytes()
    summary = csf.Run(fixtures.compose(*CFG, "mode=validate", "checkpoint.resume=auto"), output_dir=finished).validate()
    assert (finished / "summary.json").read_bytes() == trained
    on_disk = json.loads((finished / "summary-validate.json").read_text())
    assert on_disk["mode"] == "validate" and on_disk["metrics"] == summary["metrics"] and "val/loss" in on_disk["metrics"]
    elsewhere = finished / "evaluated"
    csf.Run(fixtures.compose(*CFG, "mode=validate", f"checkpoint.resume={finished}"), output_dir=elsewhere).validate()
    assert json.loads((elsewhere / "summary.json").read_text())["mode"] == "validate"


def test_resume_auto_over_a_run_without_checkpoints_is_refused_not_mixed_with_it(tmp_path):
    """A run that trained but kept no checkpoint cannot be continued: ``resume=auto`` there started a new run
    on top of it (its metrics.csv rows appended to the old run's, its summary.json replaced); now it is
    refused, or with ``start_over`` the old run is moved aside first. A directory whose run failed without a
    checkpoint is still started again by ``resume=auto``, as before."""
    csf.Run(fixtures.compose("loop.max_steps=3", "loop.eval_every=null", "checkpoint.save_at_end=false"),
            output_dir=tmp_path).fit()
    assert not (tmp_path / "checkpoints").exists()
    before = snapshot(tmp_path)
    again = ["loop.max_steps=2", "loop.eval_every=null", "checkpoint.resume=auto"]
    with pytest.raises(RunDirHoldsRun, match="holds a run that trained .* but has no checkpoint") as refused:
        csf.Run(fixtures.compose(*again), output_dir=tmp_path).fit()
    assert refused.value.exit_code == 2 and snapshot(tmp_path) == before
    summary = csf.Run(fixtures.compose(*again, "checkpoint.start_over=true"), output_dir=tmp_path).fit()
    assert summary["global_step"] == 2
    [moved] = (tmp_path / PREVIOUS_RUNS).iterdir()
    assert (moved / "metrics.csv").read_bytes() == before["metrics.csv"]
    failed_run = tmp_path / "failed_run"
    failed_run.mkdir()
    (failed_run / "events.jsonl").write_text('{"event": "fit_failed"}\n')
    (failed_run / "summary.json").write_text('{"status": "failed", "global_step": 1, "metrics": {}}')
    assert csf.Run(fixtures.compose(*again), output_dir=failed_run).fit()["global_step"] == 2


def test_a_checkpoint_of_an_earlier_run_in_previous_runs_is_not_resumed_over_the_new_run(finished):  # item 4
    csf.Run(fixtures.compose(*CFG, "checkpoint.start_over=true"), output_dir=finished).fit()
    [earlier] = (finished / PREVIOUS_RUNS).iterdir()
    old = earlier / "checkpoints" / "step-00000001"
    before = snapshot(finished)
    with pytest.raises(RunDirHoldsRun) as refused:
        csf.Run(fixtures.compose(*CFG, f"checkpoint.resume={old}"), output_dir=finished).fit()
    message = str(refused.value)
    assert message.startswith(f"checkpoint.resume={old}: checkpoint {old} is of run ")
    assert f"not of the run that run directory {finished} holds" in message and "\n" not in message
    assert "resume it into a new run directory (hydra.run.dir=...)" in message
    assert "checkpoint.start_over=true" in message and "checkpoint.resume=auto" in message
    assert snapshot(finished) == before
    # a checkpoint of the run there is resumed; the earlier one resumes in a new directory
    own = finished / "checkpoints" / "step-00000001"
    assert csf.Run(fixtures.compose(*CFG, f"checkpoint.resume={own}"), output_dir=finished).fit()["global_step"] == 2
    elsewhere = finished.parent / f"{finished.name}-new"
    assert csf.Run(fixtures.compose(*CFG, f"checkpoint.resume={old}"), output_dir=elsewhere).fit()["global_step"] == 2


def test_start_over_with_a_read_only_checkpoints_directory_moves_nothing(finished):  # item 5
    (finished / "checkpoints").chmod(0o555)  # the modes decide, so this holds for root as well
    try:
        before = snapshot(finished)
        with pytest.raises(RunDirHoldsRun) as refused:
            csf.Run(fixtures.compose(*CFG, "checkpoint.start_over=true"), output_dir=finished).fit()
        assert str(refused.value) == (
            f"checkpoint.start_over=true: cannot move checkpoints of run directory {finished} into "
            f"{PREVIOUS_RUNS}/ (it is a read-only directory (mode 0555)); nothing was moved: the run there is as "
            f"it was; chmod u+w {finished / 'checkpoints'}, or start the new run in another directory "
            "(hydra.run.dir=...)")
        assert snapshot(finished) == before and not (finished / PREVIOUS_RUNS).exists()
    finally:
        (finished / "checkpoints").chmod(0o755)
    # docs/durability.md shows the line as the CLI prints it
    shown = f"csframework: error: {str(refused.value).replace(str(finished), '/home/me/runs/a')}"
    assert shown in (ROOT / "docs" / "durability.md").read_text().splitlines()


def test_a_start_over_that_fails_midway_puts_back_what_it_moved(finished, monkeypatch):  # item 5
    before = snapshot(finished)
    real_rename, calls = os.rename, []

    def rename(src, dst, **kwargs):  # the third move fails, as an immutable file's would
        calls.append(src)
        if len(calls) == 3:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_rename(src, dst, **kwargs)

    run = csf.Run(fixtures.compose(*CFG, "checkpoint.start_over=true"), output_dir=finished)
    monkeypatch.setattr(previous_runs.os, "rename", rename)
    with pytest.raises(RunDirHoldsRun) as refused:
        run.fit()
    stuck = calls[2]
    assert str(refused.value).startswith(f"checkpoint.start_over=true: cannot move {stuck} of run directory "
                                         f"{finished} into {PREVIOUS_RUNS}/ (Operation not permitted); nothing "
                                         f"was moved: the run there is as it was; make {finished / stuck} movable")
    assert calls[3:] == calls[:2][::-1]  # the two moved are put back, the newest first
    assert snapshot(finished) == before and not (finished / PREVIOUS_RUNS).exists()


def test_a_directory_holding_only_an_earlier_runs_events_holds_a_run(finished):  # item 6
    for name in ("checkpoints", "summary.json", "metrics.csv", "curves.png"):
        path = finished / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (finished / ".hydra").mkdir()
    (finished / ".hydra" / "config.yaml").write_text("seed: 0\n")
    before = snapshot(finished)
    with pytest.raises(RunDirHoldsRun, match=re.escape(f"run directory {finished} holds a run (events.jsonl); "
                                                       "continue it with: ")):
        csf.Run(fixtures.compose(*CFG), output_dir=finished).fit()
    assert snapshot(finished) == before


def test_a_start_over_that_cannot_put_everything_back_says_where_it_is(tmp_path, monkeypatch):  # item 5
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(name)
    real_rename, run_dir = os.rename, tmp_path.stat().st_ino

    def rename(src, dst, *, src_dir_fd, dst_dir_fd):  # c.txt cannot be moved, b.txt cannot be put back
        back = os.fstat(dst_dir_fd).st_ino == run_dir
        if src == ("b.txt" if back else "c.txt"):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(previous_runs.os, "rename", rename)
    with pytest.raises(RunDirHoldsRun) as refused:
        previous_runs.move_aside(SafeDir(tmp_path))
    [holder] = (tmp_path / PREVIOUS_RUNS).iterdir()
    assert str(refused.value) == (
        f"checkpoint.start_over=true: cannot move c.txt of run directory {tmp_path} into {PREVIOUS_RUNS}/ "
        f"(Operation not permitted); 1 of its entries could not be put back and are in {holder} (b.txt); make "
        f"{tmp_path / 'c.txt'} movable (its permissions, or lsattr for an immutable flag), or start the new run "
        "in another directory (hydra.run.dir=...)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "c.txt", PREVIOUS_RUNS]
    assert [p.name for p in holder.iterdir()] == ["b.txt"]

"""Hostile sweep directories (issue 27): the attacks of test_hostile_run_dir.py on a multirun (``-m``, two
tiny jobs). For each: the multirun ends within a bounded time, without a traceback, and either completes or
exits 1/2 with a ``csframework:`` line naming the planted path; everything outside the sweep directory (a
victim tree, another run, the working directory) is byte-identical afterwards, nothing created or removed.

``FRESH`` attacks plant into an empty sweep directory; ``RESUMED`` ones into a copy of a completed sweep run
again with ``checkpoint.resume=auto`` (sweep state is evidence, not truth: an unreadable table is rebuilt
from the job directories, a forged job summary does not make a job count as done).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import csframework as csf
import fixtures
import hostile
from fixtures import CONF
from hostile import Hostile, assert_sweep_outcome, strict_json

pytestmark = pytest.mark.slow

SWEEP = ["-m", "--config-dir", CONF, "model=blobs_mlp", "data=blobs", "optimizer=sgd", "loop.max_steps=2",
         "loop.eval_every=null", "loop.eval_steps=null", "loop.log_every=1", "checkpoint.every_steps=1",
         "checkpoint.keep_last=1", "backend.threads=1", "optimizer.lr=0.1,0.05"]
RESUME = [*SWEEP, "checkpoint.resume=auto"]


def _multirun(h: Hostile, sweep_dir: Path, args, env) -> hostile.Outcome:
    return h.cli([*args, f"hydra.sweep.dir={sweep_dir}"], env, hostile.SWEEP_TIMEOUT)


@pytest.fixture(scope="module")
def template(tmp_path_factory, cli_env_module):
    """A completed two-job sweep and a completed run (checkpoints at steps 2, 4) beside it."""
    base = tmp_path_factory.mktemp("hostile-sweep-template")
    csf.Run(fixtures.compose("loop.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5"),
            output_dir=base / "other").fit()
    out = hostile.cli([*SWEEP, f"hydra.sweep.dir={base / 'sweep'}"], cli_env_module, base, hostile.SWEEP_TIMEOUT)
    assert out.returncode == 0, str(out)
    return base


class Area:
    def __init__(self, template: Path, tmp_path: Path, resumed: bool):
        self.root = tmp_path / "area"
        self.root.mkdir()
        self.other = self.root / "other"
        shutil.copytree(template / "other", self.other, symlinks=True)
        self.sweep = self.root / "sweep"
        if resumed:
            shutil.copytree(template / "sweep", self.sweep, symlinks=True)
        else:
            self.sweep.mkdir()
        self.h = Hostile(self.root)

    def plant(self, where: str, kind: str) -> Path:
        path = self.sweep / where
        if kind == "deep":
            return self.h.plant(path, "forged", content=hostile.deep_json())
        if kind == "oversized":
            return self.h.plant(path, "oversized", content=b'[{"job": 0, "status": "')
        if kind == "job-dir-to-other":
            return self.h.plant(path, "symlink-dir", target=self.other)
        if kind.startswith("forged:"):
            return self.h.plant(path, "forged", content=kind[len("forged:"):].encode())
        return self.h.plant(path, kind)

    def multirun(self, env, args) -> hostile.Outcome:
        return _multirun(self.h, self.sweep, args, env)


@pytest.fixture
def fresh(template, tmp_path):
    return Area(template, tmp_path, resumed=False)


@pytest.fixture
def resumed(template, tmp_path):
    return Area(template, tmp_path, resumed=True)


def assert_table_rebuilt(sweep_dir: Path, fresh: bool = False) -> None:
    """After a multirun that completed: ``sweep.json`` is strict JSON listing both jobs completed; in a
    fresh sweep each in a real job directory of this sweep (a copied sweep's rows may name where it was
    copied from)."""
    rows = strict_json((sweep_dir / "sweep.json").read_text())
    assert [(r["job"], r["status"]) for r in rows] == [(0, "completed"), (1, "completed")], rows
    for r in rows:
        run_dir = Path(r["run_dir"])
        assert run_dir.name == str(r["job"]), r
        if fresh:
            assert run_dir == sweep_dir / str(r["job"]) and run_dir.is_dir() and not run_dir.is_symlink(), r


FRESH = [
    (".jobs", "symlink-dir"),
    (".jobs", "dangling"),
    (".jobs", "file"),
    (".jobs", "fifo"),
    (".sweep.lock", "symlink-file"),
    (".sweep.lock", "dangling"),
    (".sweep.lock", "hardlink"),
    (".sweep.lock", "fifo"),
    (".sweep.lock", "dir"),
    ("multirun.yaml", "symlink-file"),
    ("multirun.yaml", "hardlink"),
    ("multirun.yaml", "dangling"),
    ("sweep.json", "symlink-file"),
    ("sweep.json", "hardlink"),
    ("sweep.csv", "symlink-file"),
    ("sweep.csv", "dangling"),
    ("sweep.png", "symlink-file"),
    (".sweep.png.tmp", "symlink-file"),
    (".sweep.png.tmp", "dangling"),
    (".interrupted", "dir"),
    (".interrupted", "fifo"),
    (".refused", "dir"),
    ("0", "job-dir-to-other"),
    ("0", "symlink-dir"),
    ("0", "file"),
    ("0/summary.json", "fifo"),
    ("0/.hydra", "symlink-dir"),
]


@pytest.mark.parametrize("where, kind", FRESH, ids=[f"{w}-{k}" for w, k in FRESH])
def test_a_new_sweep_over_a_planted_path(fresh, cli_env, where, kind):
    planted = fresh.plant(where, kind)
    fresh.h.guard(fresh.sweep)
    out = fresh.multirun(cli_env, SWEEP)
    assert_sweep_outcome(out, planted)
    fresh.h.assert_untouched()
    if out.returncode == 0:  # success is success: both jobs ran, in the sweep's own job directories
        assert_table_rebuilt(fresh.sweep, fresh=True)


RESUMED = [
    ("sweep.json", "forged:{\"rows\": [1, 2]}"),             # wrong shape: an object
    ("sweep.json", "forged:[1, \"two\", null]"),              # a list, but not of rows
    ("sweep.json", "forged:[{\"job\": \"0\", \"status\": 7}]"),  # rows of the wrong types
    ("sweep.json", "forged:\"completed\""),                   # string-valued
    ("sweep.json", "forged:[{\"job\": 0, \"status\": \"comp"),  # cut short
    ("sweep.json", "deep"),
    ("sweep.json", "oversized"),
    ("sweep.json", "fifo"),
    ("sweep.json", "dir"),
    ("sweep.csv", "forged:\x00\x01garbage,\"unterminated\n"),
    ("sweep.csv", "fifo"),
    ("sweep.csv", "dir"),
    ("0/summary.json", "fifo"),
    ("0/summary.json", "forged:{\"status\": "),
    ("0/summary.json", "deep"),
    ("0/summary.json", "oversized"),
    ("0/summary.json", "forged:[\"completed\"]"),
    ("0", "job-dir-to-other"),
    (".jobs", "symlink-dir"),
    (".interrupted", "dir"),
    (".sweep.lock", "hardlink"),
]


@pytest.mark.parametrize("where, kind", RESUMED, ids=[f"{w}-{k.split(':')[0]}-{i}" for i, (w, k) in enumerate(RESUMED)])
def test_resuming_a_sweep_over_a_planted_path(resumed, cli_env, where, kind):
    planted = resumed.plant(where, kind)
    resumed.h.guard(resumed.sweep)
    out = resumed.multirun(cli_env, RESUME)
    assert_sweep_outcome(out, planted)
    resumed.h.assert_untouched()
    if out.returncode == 0 and where in ("sweep.json", "sweep.csv"):
        assert_table_rebuilt(resumed.sweep)


def _forge_completed(job_dir: Path, metric: float) -> None:
    summary = json.loads((job_dir / "summary.json").read_text())
    summary["status"] = "completed"
    summary["metrics"]["val/loss"] = metric
    (job_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize("forgery", ["no-checkpoints", "step-beyond-checkpoints"])
def test_a_forged_completed_summary_does_not_skip_the_job(resumed, cli_env, forgery):
    """Job 1's ``summary.json`` says ``completed`` with a made-up metric, but its checkpoints do not show a
    run that got there: the resumed sweep runs (or resumes) job 1 and reports its real result."""
    job = resumed.sweep / "1"
    if forgery == "no-checkpoints":
        shutil.rmtree(job / "checkpoints")
    _forge_completed(job, -123.0)
    if forgery == "step-beyond-checkpoints":
        summary = json.loads((job / "summary.json").read_text())
        summary["global_step"] = 999
        (job / "summary.json").write_text(json.dumps(summary))
    resumed.h.guard(resumed.sweep)
    out = resumed.multirun(cli_env, RESUME)
    hostile.assert_bounded(out)
    assert out.returncode == 0, str(out)
    resumed.h.assert_untouched()
    rows = strict_json((resumed.sweep / "sweep.json").read_text())
    row = next(r for r in rows if r["job"] == 1)
    assert row["status"] == "completed" and row.get("val/loss") != -123.0, row
    assert row["global_step"] == 2, row
    summary = strict_json((job / "summary.json").read_text())
    assert summary["metrics"]["val/loss"] != -123.0 and summary["global_step"] == 2
    assert (job / "checkpoints" / "step-00000002").is_dir()


def test_the_helper_sees_a_sweep_that_deletes_through_jobs(fresh, cli_env):
    """The corpus can fail: a ``.jobs`` link whose victim files disappear is reported (simulated here by
    removing one, as the multirun's start did on main)."""
    fresh.plant(".jobs", "symlink-dir")
    fresh.h.guard(fresh.sweep)
    (fresh.sweep / ".jobs" / "123").unlink()
    with pytest.raises(AssertionError, match="removed: victim/dir/123"):
        fresh.h.assert_untouched()

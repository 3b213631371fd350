"""``csframework.rundir``.

One writer per run directory (issue 9, item 2): a second run on a directory in use exits 2 naming the
first, which completes untouched; the lock goes with its holder however that ends."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import csframework as csf
from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from csframework.rundir import LOCK_NAME, RunDirInUse, run_dir_lock

import fixtures
from fixtures import events


class SecondRun:
    """Starts another run on the same directory while the first trains (at ``at`` steps)."""

    name = "second"

    def __init__(self, run_dir: Path, at: int, mode: str = "fit"):
        self.run_dir, self.at, self.mode, self.refused = run_dir, at, mode, None

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == self.at and self.refused is None:
            second = csf.Run(fixtures.compose("loop.max_steps=3", "checkpoint.every_steps=1",
                                              "checkpoint.resume=auto"), output_dir=self.run_dir)
            with pytest.raises(RunDirInUse) as info:
                second.fit() if self.mode == "fit" else second.validate()
            self.refused = (info.value, second.run_id)


@pytest.mark.parametrize("mode", ["fit", "validate"])
def test_a_second_run_on_a_directory_in_use_exits_2_naming_the_first(tmp_path, mode):
    second = SecondRun(tmp_path, at=3, mode=mode)
    first = csf.Run(fixtures.compose("loop.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=5"),
                    output_dir=tmp_path, plugins=[second])
    summary = first.fit()
    error, second_id = second.refused
    assert error.exit_code == 2 and isinstance(error, csf.ConfigError)
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert re.fullmatch(rf"run directory {re.escape(str(tmp_path))} is in use by another csframework run "
                        rf"\(pid {os.getpid()} on host {re.escape(socket.gethostname())}, started "
                        rf"{re.escape(holder['started'])}; lock file .*\); wait for it to finish, or give this "
                        r"run another directory \(hydra.run.dir=...\)", str(error))
    # the first completed untouched: every checkpoint indexed, its summary and log are its own
    assert summary["status"] == "completed"
    assert json.loads((tmp_path / "summary.json").read_text())["run_id"] == first.run_id
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004", "step-00000006"]
    assert sorted(p.name for p in root.iterdir()) == ["index.json", "step-00000002", "step-00000004",
                                                      "step-00000006"]
    read_checkpoint(root / "step-00000006")
    assert {e["run_id"] for e in events(tmp_path)} == {first.run_id}
    assert second_id != first.run_id


def test_the_lock_is_released_after_a_failed_run_and_check_mode_takes_none(tmp_path):
    class Crash:
        name = "crash"

        @csf.hookimpl
        def on_train_batch_end(self, run):
            # mode=check writes nothing and does not need the lock, even while a run holds it
            assert csf.Run(fixtures.compose(), output_dir=tmp_path).check()["status"] == "checked"
            raise RuntimeError("boom")

    with pytest.raises(csf.PluginError, match="boom"):
        csf.Run(fixtures.compose("loop.max_steps=4"), output_dir=tmp_path, plugins=[Crash()]).fit()
    summary = csf.Run(fixtures.compose("loop.max_steps=4", "checkpoint.resume=auto"), output_dir=tmp_path).fit()
    assert summary["status"] == "completed"


def test_a_lock_file_that_is_a_link_is_refused_naming_it(tmp_path):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).symlink_to(elsewhere)
    with pytest.raises(csf.CsfError, match=re.escape(f"{run_dir / LOCK_NAME}: cannot open it (it is a symbolic link")) as info:
        csf.Run(fixtures.compose("loop.max_steps=2"), output_dir=run_dir).fit()
    assert info.value.exit_code == 2 and elsewhere.read_text() == "keep me"
    assert not (run_dir / "events.jsonl").exists()


def test_a_forked_child_such_as_a_loader_worker_does_not_keep_the_lock(tmp_path):
    ready, told = os.pipe()
    with run_dir_lock(tmp_path):
        child = os.fork()
        if child == 0:  # a worker that outlives its run (as after a SIGKILL of the run) holds nothing
            os.write(told, b"x")  # the fork handlers have run by the time the child's own code runs
            time.sleep(60)
            os._exit(0)
        os.read(ready, 1)
    try:
        with run_dir_lock(tmp_path):  # the run ended; its worker is still alive
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


HOLD = ("import sys, time\nfrom csframework.rundir import run_dir_lock\n"
        "with run_dir_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(600)\n")


@pytest.mark.slow
def test_the_cli_refuses_a_directory_in_use_and_the_lock_dies_with_its_holder(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env=cli_env)
    try:
        assert holder.stdout.readline() == "locked\n"
        r = subprocess.run([sys.executable, "-m", "csframework", "--config-dir", fixtures.CONF, *fixtures.TINY,
                            f"hydra.run.dir={run_dir}"], env=cli_env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert (f"csframework: error: run directory {run_dir} is in use by another csframework run "
                f"(pid {holder.pid} on host {socket.gethostname()}, started ") in r.stderr
        assert "Traceback" not in r.stderr
        assert not (run_dir / "events.jsonl").exists() and not (run_dir / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    with run_dir_lock(run_dir):  # no stale lock: the OS released it with the killed process
        pass


# -- one run per run directory (issue 39 item 2) ---------------------------------------------------------------
def test_a_fresh_fit_over_a_run_is_refused_and_start_over_moves_the_old_run_aside(tmp_path):
    from csframework.errors import RunDirHoldsRun
    from csframework.previous_runs import PREVIOUS_RUNS

    cfg = ["loop.max_steps=2", "loop.eval_every=null"]
    csf.Run(fixtures.compose(*cfg), output_dir=tmp_path).fit()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(RunDirHoldsRun, match=re.escape(f"run directory {tmp_path} holds a run (checkpoints, "
                                                       "summary.json, metrics.csv, events.jsonl)")) as refused:
        csf.Run(fixtures.compose(*cfg), output_dir=tmp_path).fit()
    assert refused.value.exit_code == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != LOCK_NAME} == before
    # resume=auto continues it; start_over moves every file of the old run aside, links and all, first
    csf.Run(fixtures.compose(*cfg, "checkpoint.resume=auto"), output_dir=tmp_path).fit()
    os.symlink("/etc/passwd", tmp_path / "planted")
    csf.Run(fixtures.compose(*cfg, "checkpoint.start_over=true"), output_dir=tmp_path).fit()
    [moved] = (tmp_path / PREVIOUS_RUNS).iterdir()
    assert (moved / "planted").is_symlink() and {"summary.json", "metrics.csv", "checkpoints"} <= {
        p.name for p in moved.iterdir()}
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == 2
    with open(tmp_path / "metrics.csv") as f:
        steps = [line.split(",")[0] for line in f if ",train/loss," in line]
    assert steps == ["2"]  # the new run's rows alone

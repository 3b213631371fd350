"""Nothing hangs forever and no loader worker outlives its run (issue 9, item 6), through the CLI: the loader
of ``csframework.data`` under signals and SIGKILL (the in-process cases: tests/unit/test_data.py).

A loader worker stuck in ``__getitem__`` fails the run after ``data.timeout_s`` with an error naming the
loader, the worker and its pid; whatever ends a run (completion, a failure, a hook error, SIGTERM, SIGINT,
a second signal, SIGKILL of the main process) leaves no worker process behind. ``Stalling`` workers write
their pid into a directory, so each test checks the very processes of its run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import CONF, TINY
from forkrun import run_chains
from stalling import TIMEOUT_S, hung_pid, stalling, survivors, worker_pids

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


# -- the CLI, stopped by signals --------------------------------------------------------------------------
ARGS = ["--config-dir", CONF, *TINY, "data.num_workers=2", "loop.max_steps=6", "checkpoint.every_steps=2",
        "plugins.enable=[durability_plugin:Killer]"]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, cli_env_module):
    """CLI runs (forked by ``forkrun``), each with its pid directory and run directory."""
    tmp = tmp_path_factory.mktemp("cli")
    cases = {
        # worker 0 hangs on its first sample
        "hang": ([f"data.timeout_s={TIMEOUT_S}", *stalling(tmp / "hang" / "pids", hang_worker=0)], {}),
        # mode=validate, the validation worker hangs
        "validate": (["mode=validate", "data.num_workers=1", f"data.timeout_s={TIMEOUT_S}",
                      *stalling(tmp / "validate" / "pids", "val", hang_worker=0)], {}),
        # SIGTERM / SIGINT to the main process only, in step 2's last hook: the run stops after step 3
        "term": (stalling(tmp / "term" / "pids"), {"CSF_TEST_KILL": "batch_end@2", "CSF_TEST_SIGNAL": "TERM"}),
        "int": (stalling(tmp / "int" / "pids"), {"CSF_TEST_KILL": "batch_end@2", "CSF_TEST_SIGNAL": "INT"}),
        # worker 1 hangs (a timeout long enough not to matter): the first SIGTERM cannot stop the run at a
        # step boundary, as the main process waits for the batch; the second exits at once (os._exit)
        "term-twice": (["data.timeout_s=60",
                        *stalling(tmp / "term-twice" / "pids", hang_worker=1, signal_parent="TERM-TERM")], {}),
    }
    chains = [[{"argv": ARGS + overrides + [f"hydra.run.dir={tmp / name / 'run'}"], "env": env}]
              for name, (overrides, env) in cases.items()]
    results = run_chains(chains, cli_env_module, parallel=2, timeout=300)
    return {name: (results[i][0], tmp / name) for i, name in enumerate(cases)}


@pytest.mark.slow
@pytest.mark.parametrize("name, key", [("hang", "data.train"), ("validate", "data.val")])
def test_cli_a_hung_worker_is_one_line_naming_it_and_exit_1(cli_runs, name, key):
    result, tmp = cli_runs[name]
    pids = tmp / "pids"
    assert result["returncode"] == 1, result["stderr"][-2000:]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("csframework: error:")]
    assert errors == [f"csframework: error: {key}: loader worker 0 (pid {hung_pid(pids)}) gave no batch in "
                      f"{TIMEOUT_S} s (data.timeout_s) and was stopped: Stalling.__getitem__ hangs or is too "
                      "slow; fix it, or raise data.timeout_s (0 waits forever)"]
    assert "Traceback" not in result["stderr"]
    assert json.loads((tmp / "run" / "summary.json").read_text())["status"] == "failed"
    assert survivors(pids) == []


@pytest.mark.slow
@pytest.mark.parametrize("name, status", [("term", 143), ("int", 130)])
def test_cli_a_stop_signal_saves_stops_and_leaves_no_worker(cli_runs, name, status):
    result, tmp = cli_runs[name]
    assert result["returncode"] == status, result["stderr"][-2000:]
    assert "stopped by SIG" in result["stderr"] and "after step 3" in result["stderr"]
    assert json.loads((tmp / "run" / "summary.json").read_text())["status"] == "interrupted"
    assert len(worker_pids(tmp / "pids")) == 2
    assert survivors(tmp / "pids") == []  # gone when the main process exits: stopped, not orphaned


@pytest.mark.slow
def test_cli_a_second_signal_exits_at_once_and_even_a_hung_worker_goes(cli_runs):
    result, tmp = cli_runs["term-twice"]
    assert result["returncode"] == 143, result["stderr"][-2000:]
    assert "SIGTERM again: exiting now" in result["stderr"]
    hung = hung_pid(tmp / "pids")
    assert survivors(tmp / "pids", within=10) == [], f"hung worker {hung} outlived the run"


@pytest.mark.slow
def test_sigkill_of_the_main_process_takes_every_worker_with_it(tmp_path, cli_env):
    """Worker 1 kills the main process, then sleeps in ``__getitem__``, where it never looks for its parent
    as an idle torch worker does: the kernel kills it with the main process."""
    pids = tmp_path / "pids"
    killed = subprocess.run([sys.executable, "-m", "csframework", *ARGS, "data.timeout_s=0",
                             *stalling(pids, hang_worker=1, signal_parent="KILL"),
                             f"hydra.run.dir={tmp_path / 'run'}"], env=cli_env, capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(worker_pids(pids)) == 2 and hung_pid(pids) in worker_pids(pids)
    assert survivors(pids, within=10) == []


@pytest.mark.slow
def test_ctrl_c_to_the_whole_process_group_stops_the_run_and_its_workers(tmp_path, cli_env):
    """A terminal's Ctrl-C reaches the workers too: they ignore it, the run stops after the current step."""
    pids = tmp_path / "pids"
    run = subprocess.Popen([sys.executable, "-m", "csframework", "--config-dir", CONF, *TINY,
                            "data.num_workers=2", "loop.max_steps=100000", "loop.log_every=1",
                            *stalling(pids, delay=0.002), f"hydra.run.dir={tmp_path / 'run'}"],
                           env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(worker_pids(pids)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(worker_pids(pids)) == 2, "the workers did not start"
        os.killpg(run.pid, signal.SIGINT)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:  # pragma: no cover - only when the test already failed
            run.kill()
    assert run.returncode == 130, stderr[-2000:]
    assert "csframework: interrupted: stopped by SIGINT" in stderr
    assert survivors(pids) == []

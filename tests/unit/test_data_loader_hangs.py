"""Nothing hangs forever and no loader worker outlives its run (issue 9, item 6).

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
from torch.utils.data import get_worker_info

import csframework as csf
from csframework.config.sections import DataConfig
from csframework.errors import DataTimeoutError, PluginError, ValidationError
from fixtures import CONF, TINY, Blobs, compose
from forkrun import run_chains

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

TIMEOUT_S = 2
#: generous bound for "fails within data.timeout_s + a few seconds" on a loaded machine; the default
#: timeout (600 s) or none at all would exceed it
BOUND_S = TIMEOUT_S + 25


class Stalling(Blobs):
    """Blobs whose loader workers record their pid as a file in ``pid_dir``; worker ``hang_worker`` sleeps
    forever on its ``after + 1``-th sample, after writing ``hung-<pid>`` and, once every worker has recorded
    its pid, sending the main process the signals ``signal_parent`` lists (e.g. ``KILL``, ``TERM-TERM``; one second apart, so none merge into
    the one before); ``delay`` slows every sample."""

    def __init__(self, pid_dir: str, hang_worker: int = -1, after: int = 0, delay: float = 0.0,
                 signal_parent: str = "", **kwargs):
        super().__init__(**kwargs)
        self.pid_dir, self.hang_worker, self.after, self.delay = Path(pid_dir), hang_worker, after, delay
        self.signal_parent = [getattr(signal, f"SIG{name}") for name in signal_parent.split("-") if name]
        self.served = 0  # per worker process (each has its own copy)

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None:
            if self.served == 0:
                self.pid_dir.mkdir(parents=True, exist_ok=True)
                (self.pid_dir / str(os.getpid())).touch()
            self.served += 1
            if info.id == self.hang_worker and self.served > self.after:
                (self.pid_dir / f"hung-{os.getpid()}").touch()
                deadline = time.monotonic() + 60
                while len(worker_pids(self.pid_dir)) < info.num_workers and time.monotonic() < deadline:
                    time.sleep(0.05)  # every worker is recorded before the main process is signalled
                for signum in self.signal_parent:
                    os.kill(os.getppid(), signum)
                    time.sleep(1)
                time.sleep(10**6)
        if self.delay:
            time.sleep(self.delay)
        return super().__getitem__(i)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def worker_pids(pid_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in pid_dir.iterdir() if p.name.isdigit()) if pid_dir.is_dir() else []


def hung_pid(pid_dir: Path) -> int:
    (found,) = [int(p.name.split("-")[1]) for p in pid_dir.glob("hung-*")]
    return found


def survivors(pid_dir: Path, within: float = 0.0) -> list[int]:
    """The recorded workers still running after waiting up to ``within`` seconds for them to go."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid in worker_pids(pid_dir) if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def stalling(pid_dir: Path, key: str = "train", **options) -> list[str]:
    """Overrides making ``data.<key>`` a ``Stalling`` set recording into ``pid_dir``."""
    return [f"data.{key}._target_=test_data_loader_hangs.Stalling", f"+data.{key}.pid_dir={pid_dir}",
            *(f"++data.{key}.{name}={value}" for name, value in options.items())]


def fit_fails(run: csf.Run, error: type) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(error) as failed:
        run.fit()
    return failed.value, time.monotonic() - start


# -- in-process runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers, hang_worker, after", [(1, 0, 0), (2, 1, 20)],
                         ids=["one-worker-first-batch", "second-of-two-workers-mid-epoch"])
@pytest.mark.slow
def test_a_hung_worker_fails_the_run_naming_it_and_no_worker_survives(tmp_path, num_workers, hang_worker, after):
    pids = tmp_path / "pids"
    run = csf.Run(compose(f"data.num_workers={num_workers}", f"data.timeout_s={TIMEOUT_S}",
                          *stalling(pids, hang_worker=hang_worker, after=after)), output_dir=tmp_path / "run")
    error, took = fit_fails(run, DataTimeoutError)
    message = str(error)
    assert f"data.train: loader worker {hang_worker} (pid {hung_pid(pids)})" in message
    assert "data.timeout_s" in message and f"in {TIMEOUT_S} s" in message and "Stalling" in message
    assert took < BOUND_S
    assert run.status == "failed" and error.exit_code == 1
    assert len(worker_pids(pids)) == num_workers and survivors(pids) == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


@pytest.mark.slow
def test_a_hung_validation_worker_names_the_validation_loader_and_stops_the_training_workers(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    run = csf.Run(compose("data.num_workers=2", f"data.timeout_s={TIMEOUT_S}", "loop.max_steps=4",
                          *stalling(train), *stalling(val, "val", hang_worker=0)),
                  output_dir=tmp_path / "run")
    error, took = fit_fails(run, DataTimeoutError)
    assert f"data.val: loader worker 0 (pid {hung_pid(val)})" in str(error) and took < BOUND_S
    # the training pass stopped after 4 of its 8 batches, its workers still waiting for work: stopped too
    assert len(worker_pids(train)) == 2 and survivors(train) == []
    assert len(worker_pids(val)) == 2 and survivors(val) == []


@pytest.mark.slow
def test_validate_mode_with_a_hung_worker_fails_and_leaves_no_worker(tmp_path):
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=1", f"data.timeout_s={TIMEOUT_S}",
                          *stalling(pids, "val", hang_worker=0)), output_dir=tmp_path / "run")
    with pytest.raises(DataTimeoutError, match=r"data\.val: loader worker 0 \(pid \d+\)"):
        run.validate()
    assert run.status == "failed" and survivors(pids) == []


class FailsOnceWorkerHangs:
    """Raises in the first step's last hook, once the ``Stalling`` worker of ``pid_dir`` hangs."""

    name = "fails_once_a_worker_hangs"

    def __init__(self, pid_dir: Path):
        self.pid_dir = pid_dir

    @csf.hookimpl
    def on_train_batch_end(self, run):
        deadline = time.monotonic() + 60
        while not list(self.pid_dir.glob("hung-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("boom")


@pytest.mark.slow
def test_a_hook_error_while_a_worker_hangs_leaves_no_worker(tmp_path):
    """No timeout, worker 1 stuck in ``__getitem__``, and the run fails for another reason: torch's own
    shutdown gives up on a worker that does not stop (and SIGTERM does not reach it); the run kills it."""
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=2", "data.timeout_s=0", *stalling(pids, hang_worker=1)),
                  plugins=[FailsOnceWorkerHangs(pids)], output_dir=tmp_path / "run")
    with pytest.raises(PluginError, match="boom"):
        run.fit()
    assert run.status == "failed"
    assert len(worker_pids(pids)) == 2 and hung_pid(pids) in worker_pids(pids)
    assert survivors(pids) == []


@pytest.mark.slow
def test_a_completed_run_that_stops_mid_epoch_leaves_no_worker(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    run = csf.Run(compose("data.num_workers=2", "loop.max_steps=5", "loop.eval_every=2", "loop.eval_steps=1",
                          *stalling(train), *stalling(val, "val")), output_dir=tmp_path / "run")
    assert run.fit()["status"] == "completed"
    assert worker_pids(train) and worker_pids(val)
    assert survivors(train) == [] and survivors(val) == []


@pytest.mark.slow
def test_a_slow_worker_within_the_timeout_per_batch_does_not_trip_it(tmp_path):
    """The timeout bounds the wait for one batch, not a pass: 8 batches of 16 samples x 30 ms take at least
    3.8 s in all, more than the 3 s timeout, but under 0.5 s each."""
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=1", "data.timeout_s=3", "loop.max_steps=8",
                          *stalling(pids, delay=0.03)), output_dir=tmp_path / "run")
    assert run.fit()["status"] == "completed"
    assert survivors(pids) == []


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_a_config_error(value):
    with pytest.raises(ValidationError, match=r"data\.timeout_s: .* must be (a finite number )?between 0 and \d+ seconds"):
        csf.Run(compose("data.num_workers=1", f"data.timeout_s={value}"))


def test_the_timeout_reaches_the_loader_only_with_workers():
    with_workers = csf.Run(compose("data.num_workers=1", "data.timeout_s=7"))
    assert with_workers.train_loader.timeout == 7 and with_workers.val_loader.timeout == 7
    assert csf.Run(compose("data.num_workers=0", "data.timeout_s=7")).train_loader.timeout == 0
    assert DataConfig().timeout_s == 600


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

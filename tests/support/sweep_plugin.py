"""A plugin for the sweep tests (``plugins.enable=[sweep_plugin]``; CLI runs put tests/ on PYTHONPATH).

Driven by the environment, for the job whose ``optimizer.lr`` is given:
(each a comma-separated list of ``<lr>@<number>``)
    CSF_TEST_SLOW=<lr>@<seconds>     sleep that long after every step of that job (a job still running)
    CSF_TEST_STOP_SWEEP=<lr>@<step>  at that step, send SIGTERM to the multirun's parent process, as a user
                                     would (``kill <pid>``); CSF_TEST_PIDS names a file that then gets every
                                     process of the sweep (the parent and its descendants), one pid a line
    CSF_TEST_HELPER=<lr>@<step>      at that step, start a helper process of the job's that ignores SIGTERM,
                                     leaves the job's tree of processes (its parent exits: init adopts it) and
                                     sleeps 120 s (as a resource tracker whose process died), before
                                     CSF_TEST_STOP_SWEEP's SIGTERM at the same step
    CSF_TEST_KILL_WORKER=<lr>@<step> at that step, SIGKILL the job's own process (a joblib worker dying, as
                                     under the OOM killer), once the file CSF_TEST_KILL_AFTER names exists
                                     (waits for it up to 120 s, when given)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import csframework as csf
from csframework.sweep.job import PARENT_ENV


def _target(name: str, lr: float) -> float | None:
    """The number given for ``lr`` in ``name`` (``<lr>@<number>[,<lr>@<number>...]``), else None."""
    for item in filter(None, os.environ.get(name, "").split(",")):
        at, _, number = item.partition("@")
        if float(at) == lr:
            return float(number)
    return None


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


#: CSF_TEST_HELPER's process: it ignores SIGTERM, forks, and its parent exits (so init adopts it); it says its
#: pid, closes its output (which would hold the test's pipes open) and sleeps.
_HELPER = """import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    print(os.getpid(), flush=True)
    os.close(1)
    time.sleep(120)
"""


@csf.hookimpl
def on_train_batch_end(run):
    lr = run.config.optimizer.lr
    slow, stop = _target("CSF_TEST_SLOW", lr), _target("CSF_TEST_STOP_SWEEP", lr)
    if _target("CSF_TEST_KILL_WORKER", lr) == run.global_step:
        after = os.environ.get("CSF_TEST_KILL_AFTER")
        deadline = time.monotonic() + 120
        while after and not Path(after).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    if slow:
        time.sleep(slow)
    helpers = []
    if _target("CSF_TEST_HELPER", lr) == run.global_step:  # its pid on its stdout, which it then closes
        helper = subprocess.run([sys.executable, "-c", _HELPER], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, timeout=60)
        helpers.append(int(helper.stdout))
    if stop == run.global_step:
        parent = int(os.environ[PARENT_ENV])
        if os.environ.get("CSF_TEST_PIDS"):
            pids = descendants(parent) + helpers
            Path(os.environ["CSF_TEST_PIDS"]).write_text("".join(f"{p}\n" for p in pids))
        os.kill(parent, signal.SIGTERM)

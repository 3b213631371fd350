"""``csframework.signals``, in process: SIGTERM stops a run after its step (with a checkpoint) and the
handlers are restored; outside the main thread the handlers are left alone. Through the CLI:
tests/e2e/test_durability_kill.py and tests/e2e/test_loader_hangs.py."""
from __future__ import annotations

import json
import os
import signal

import pytest

import csframework as csf
from csframework.builtin.checkpoint import list_checkpoints
from csframework.signals import Interrupted, stop_on_signals
from csframework.state import RunState

import fixtures


def test_sigterm_in_process_stops_after_the_step_and_handlers_are_restored(tmp_path):
    class Term:
        name = "term"

        @csf.hookimpl
        def on_train_batch_start(self, run):
            if run.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    run = csf.Run(fixtures.compose("loop.max_steps=8"), output_dir=tmp_path, plugins=[Term()])
    with pytest.raises(Interrupted) as info:
        run.fit()
    assert info.value.exit_code == 143 and info.value.step == 4
    assert isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is before
    assert run.status == "interrupted"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "step-00000004"


def test_signal_handlers_are_left_alone_outside_the_main_thread():
    import threading

    seen = []

    def body():
        with stop_on_signals(RunState()):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


AGREED_THEN_SIGNALLED = """
import os, signal
from csframework.signals import stop_on_signals
from csframework.state import RunState

state = RunState()
with stop_on_signals(state):
    state.stop_after_this_step(signal.SIGTERM)  # the ranks agreed to stop: another rank got SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's SIGTERM to the ranks left, as that rank exits
    print("finished the stop", flush=True)  # (rank 0 saving its checkpoint and summary.json)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one of this process's own: it exits at once
    print("not reached", flush=True)
"""


def test_a_stop_agreed_for_another_ranks_signal_is_not_this_processs_first_signal():
    """Under torchrun, when the rank that got a signal exits, torchrun sends SIGTERM to the others: rank 0,
    stopping for that agreed signal and still writing the stop's checkpoint and summary.json, must finish
    them (CI saw rank 0 exit "again: exiting now" with no summary.json); a second signal of its own still
    exits at once."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", AGREED_THEN_SIGNALLED], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["finished the stop"], (done.stdout, done.stderr)
    assert done.returncode == 143
    assert "SIGTERM: finishing the current step" in done.stderr and "SIGTERM again: exiting now" in done.stderr

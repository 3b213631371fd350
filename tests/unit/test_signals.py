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

"""``csframework.builtin.checkpoint.plugin``, the checkpoint plugin: durability and safety, in process:
damaged and incompatible checkpoints, non-finite losses, failing plugins and failing writes, what a run
writes it can read back. The format of one checkpoint: test_checkpoint_format.py; the ``checkpoints/``
directory: test_checkpoint_store.py."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re

import pytest
import torch

import csframework as csf
from csframework.builtin.checkpoint import (MAX_CONFIG_BYTES, DamagedCheckpoint, list_checkpoints,
                                            read_checkpoint)

import fixtures
from fixtures import events, fit

STEADY = ["optimizer=adamw", "optimizer.lr=0.02", "+model.net.dropout=0.2", "loop.log_every=4"]


def params(run) -> dict:
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- damaged checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "flip", "no-meta", "no-state"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, damage):
    straight, _ = fit(tmp_path / "straight", "loop.max_steps=12", *STEADY)
    run_dir = tmp_path / "run"
    fit(run_dir, "loop.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=3", *STEADY)
    newest = run_dir / "checkpoints" / "step-00000008"
    state_file = newest / "state.pt"
    if damage == "truncate":
        data = state_file.read_bytes()
        state_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data = bytearray(state_file.read_bytes())
        data[len(data) * 3 // 4] ^= 0x01  # one bit inside tensor data: same size, zip still valid
        state_file.write_bytes(bytes(data))
    elif damage == "no-meta":
        (newest / "meta.json").unlink()
    else:
        state_file.unlink()
    with pytest.raises(DamagedCheckpoint, match=str(newest)):
        read_checkpoint(newest)

    resumed, summary = fit(run_dir, "loop.max_steps=12", "checkpoint.resume=auto", *STEADY)
    log = events(run_dir)
    warning = next(e for e in log if e["event"] == "checkpoint_damaged")
    assert warning["path"] == str(newest) and warning["level"] == "warning"
    assert next(e for e in log if e["event"] == "resumed")["path"] == str(run_dir / "checkpoints" / "step-00000006")
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert same(params(straight), params(resumed))


def test_an_explicit_resume_path_that_is_damaged_or_missing_is_refused(tmp_path):
    fit(tmp_path / "a", "loop.max_steps=2", "checkpoint.every_steps=1")
    newest = tmp_path / "a" / "checkpoints" / "step-00000002"
    (newest / "state.pt").write_bytes(b"garbage")
    with pytest.raises(csf.CsfError, match=re.escape(f"checkpoint.resume: checkpoint {newest}: state.pt has 7 bytes")):
        fit(tmp_path / "b", "loop.max_steps=3", f"checkpoint.resume={newest}")
    missing = tmp_path / "nowhere" / "step-00000001"
    with pytest.raises(csf.ValidationError, match=re.escape(f"checkpoint.resume: no checkpoint at '{missing}'")):
        csf.Run(fixtures.compose("loop.max_steps=3", f"checkpoint.resume={missing}"), output_dir=tmp_path / "c")


def test_resume_from_another_run_directory_takes_its_newest_good_checkpoint(tmp_path):
    first, _ = fit(tmp_path / "a", "loop.max_steps=4", "checkpoint.every_steps=2", *STEADY)
    run, summary = fit(tmp_path / "b", "loop.max_steps=6", f"checkpoint.resume={tmp_path / 'a'}", *STEADY)
    assert next(e for e in events(tmp_path / "b") if e["event"] == "resumed")["step"] == 4
    assert summary["global_step"] == 6


def test_a_checkpoint_of_another_model_is_refused_naming_the_mismatch(tmp_path):
    fit(tmp_path, "loop.max_steps=2")
    with pytest.raises(csf.PluginError) as info:
        fit(tmp_path, "loop.max_steps=4", "model.net.hidden=32", "checkpoint.resume=auto")
    message = str(info.value)
    assert "net.0.weight is [16, 8] in the checkpoint, [32, 8] in the model" in message
    assert "model.net.hidden is 16 in the checkpoint, 32 now" in message
    assert str(tmp_path / "checkpoints" / "step-00000002") in message
    assert info.value.exit_code == 2
    with pytest.raises(csf.PluginError, match="optimizer.name: its state is SGD's, this run uses AdamW"):
        fit(tmp_path, "loop.max_steps=4", "optimizer=adamw", "checkpoint.resume=auto")


def test_plugin_state_and_metrics_come_back_on_resume(tmp_path):
    class Counter:
        name = "counter"

        def __init__(self):
            self.count, self.loaded, self.metrics_at_load = 0, None, None

        @csf.hookimpl
        def on_train_batch_end(self):
            self.count += 1

        @csf.hookimpl
        def on_checkpoint_save(self, state):
            state["counter"] = {"count": self.count}

        @csf.hookimpl
        def on_checkpoint_load(self, run, state):
            self.metrics_at_load = dict(run.metrics)
            self.loaded = state["counter"]
            self.count = state["counter"]["count"]

    fit(tmp_path, "loop.max_steps=4", plugins=[Counter()])
    again = Counter()
    run, summary = fit(tmp_path, "loop.max_steps=6", "checkpoint.resume=auto", plugins=[again])
    assert again.loaded == {"count": 4} and again.count == 6
    assert "train/loss" in again.metrics_at_load  # the metrics of the checkpoint, before any new step


# -- non-finite loss ----------------------------------------------------------------------------------------
NAN_MODEL = ["model._target_=durability_plugin.NanAt", "+model.step=7", "~model.net", "~model.loss"]


@pytest.mark.parametrize("every", [1, 5])
def test_a_nan_loss_stops_the_run_naming_the_step_and_no_checkpoint_holds_it(tmp_path, every):
    with pytest.raises(csf.NonFiniteLossError, match="the loss is nan at step 7"):
        fit(tmp_path, "loop.max_steps=12", "loop.log_every=10", f"checkpoint.every_steps={every}", *NAN_MODEL)
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    state, meta = read_checkpoint(newest)
    assert state["loop"]["global_step"] == (6 if every == 1 else 5) < 7
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "step 7" in summary["error"]


@pytest.mark.slow
def test_a_nan_loss_through_the_cli_is_one_line_naming_the_step(tmp_path, cli_env):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "csframework", "--config-dir", fixtures.CONF, *fixtures.TINY,
                        "loop.max_steps=12", "checkpoint.every_steps=3", *NAN_MODEL, f"hydra.run.dir={tmp_path}"],
                       env=cli_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "csframework: error: the loss is nan at step 7" in r.stderr and "Traceback" not in r.stderr
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "step-00000006"


def test_non_finite_parameters_are_never_checkpointed(tmp_path):
    class Blowup:
        name = "blowup"

        @csf.hookimpl
        def on_before_optimizer_step(self, run, optimizer):
            if run.global_step == 4:  # during step 5: the loss is finite, the update is not
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad.fill_(float("inf"))

    with pytest.raises(csf.NonFiniteLossError, match=r"parameter net\.\d\.weight is not finite after step 5"):
        fit(tmp_path, "loop.max_steps=8", "checkpoint.every_steps=1", "loop.log_every=100", plugins=[Blowup()])
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "step-00000004"


def test_dynamic_loss_scaling_skips_non_finite_steps_then_stops_at_min_scale(tmp_path):
    # float16 on CPU with dynamic scaling: steps 7.. are NaN and skipped; the scale halves from 8 each time
    with pytest.raises(csf.NonFiniteLossError, match=r"loss scale fell to 0.5, below precision.min_scale=1, by step 10"):
        fit(tmp_path, "precision=float16", "precision.init_scale=8", "loop.max_steps=20", "loop.log_every=5",
            "checkpoint.every_steps=2", *NAN_MODEL)
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    state, meta = read_checkpoint(newest)
    assert state["loop"]["global_step"] == 8  # skipped steps left the parameters finite
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert state["backend"]["precision"]["scale"] == 2.0


def test_dynamic_loss_scaling_skips_a_single_non_finite_step_and_goes_on(tmp_path):
    run, summary = fit(tmp_path, "precision=float16", "precision.init_scale=8", "loop.max_steps=10",
                       "loop.log_every=5", "checkpoint.every_steps=1", "model._target_=durability_plugin.NanAt",
                       "+model.step=4", "+model.once=true", "~model.net", "~model.loss")
    assert summary["status"] == "completed" and summary["global_step"] == 10
    assert run.backend.loss_scale() == 4.0  # halved once
    assert summary["metrics"]["train/loss"] == summary["metrics"]["train/loss"]  # the skipped step left out
    state, _ = read_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
    assert all(torch.isfinite(t).all() for t in state["model"].values())


# -- failing plugins and writes -----------------------------------------------------------------------------
class Recorder:
    name = "watcher"

    def __init__(self):
        self.errors = []

    @csf.hookimpl
    def on_exception(self, run, error):
        self.errors.append(error)


def test_a_plugin_failing_in_a_hook_is_named_and_the_last_checkpoint_is_intact(tmp_path):
    class Faulty:
        name = "faulty"

        @csf.hookimpl
        def on_checkpoint_save(self, run, state):
            if run.global_step == 6:
                raise RuntimeError("disk quota of the plugin")

    watcher = Recorder()
    with pytest.raises(csf.PluginError, match="plugin 'faulty' in hook 'on_checkpoint_save' failed: "
                                              "RuntimeError: disk quota of the plugin"):
        fit(tmp_path, "loop.max_steps=8", "checkpoint.every_steps=2", plugins=[Faulty(), watcher])
    assert len(watcher.errors) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "faulty" in summary["error"]
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004"]
    read_checkpoint(root / "step-00000004")
    assert sorted(p.name for p in root.iterdir()) == ["index.json", "step-00000002", "step-00000004"]


def test_a_failed_checkpoint_write_is_reported_and_leaves_the_previous_intact(tmp_path, monkeypatch):
    class FullFile:  # a file on a disk that fills up after 1000 bytes
        def __init__(self, f):
            self.f, self.size = f, 0

        def write(self, data):
            if self.size + len(data) > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.size += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_fdopen = os.fdopen

    def full_fdopen(fd, mode="r", *args, **kwargs):  # files.SafeDir.atomic opens its temporary file so
        f = real_fdopen(fd, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{fd}")
        return FullFile(f) if ".state.pt." in name and "w" in mode else f

    class FillDiskAtStep6:
        name = "filler"

        @csf.hookimpl
        def on_checkpoint_save(self, run):
            if run.global_step == 6:
                monkeypatch.setattr(os, "fdopen", full_fdopen)

    watcher = Recorder()
    with pytest.raises(csf.PluginError) as info:
        fit(tmp_path, "loop.max_steps=8", "checkpoint.every_steps=2", plugins=[FillDiskAtStep6(), watcher])
    root = tmp_path / "checkpoints"
    assert (f"checkpoint: could not write {root / 'step-00000006'} (No space left on device); the previous "
            "checkpoints are intact") in str(info.value)
    assert watcher.errors and json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in root.iterdir()) == ["index.json", "step-00000002", "step-00000004"]
    read_checkpoint(root / "step-00000004")


# -- signals, in process ------------------------------------------------------------------------------------


# -- bounded memory -----------------------------------------------------------------------------------------
def test_nothing_per_step_accumulates_in_the_run(tmp_path):
    run, _ = fit(tmp_path, "loop.max_steps=40", "loop.log_every=5", "checkpoint.every_steps=10")
    assert all(len(v) == 0 for v in run.state.pending.values())
    assert len(run.metrics) < 20
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 2


# -- multi-stage resume -------------------------------------------------------------------------------------
STAGES = "+stages={warm:{optimizer:{lr:0.05},loop:{max_steps:5}},main:{optimizer:{lr:0.01},loop:{max_steps:7}}}"


@pytest.mark.parametrize("crash_at", [3, 5, 9])  # inside the first stage, at its end, inside the second
def test_a_crash_in_any_stage_resumes_to_the_uninterrupted_result(tmp_path, crash_at):
    class Crash:
        name = "crash"

        @csf.hookimpl
        def on_train_batch_end(self, run):
            if run.global_step == crash_at:
                raise RuntimeError("preempted")

    straight, summary = fit(tmp_path / "straight", STAGES, *STEADY)
    assert summary["global_step"] == 12 and summary["stage"] == "main"
    run_dir = tmp_path / "run"
    with pytest.raises(csf.PluginError, match="preempted"):
        fit(run_dir, STAGES, "checkpoint.every_steps=2", "checkpoint.resume=auto", *STEADY, plugins=[Crash()])
    resumed, summary = fit(run_dir, STAGES, "checkpoint.every_steps=2", "checkpoint.resume=auto", *STEADY)
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert same(params(straight), params(resumed))


# -- what a run writes it can read back (issue 27 item 2) ---------------------------------------------------
@dataclasses.dataclass
class BigConfig:
    """A plugin section whose default is larger than a checkpoint's config.yaml may be."""

    blob: str = "x" * (MAX_CONFIG_BYTES + 10)


class BigSection:
    name = "big"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"big": BigConfig}


def test_a_config_too_large_to_resume_from_is_refused_before_training(tmp_path):
    config = csf.compose(fixtures.TINY + ["checkpoint.every_steps=2"], config_dir=fixtures.CONF,
                         plugins=[BigSection()])
    with pytest.raises(csf.CsfError) as info:
        csf.Run(config, plugins=[BigSection()], output_dir=tmp_path).fit()
    assert info.value.exit_code == 2
    assert f"big: the run's config is" in str(info.value) and f"more than the {MAX_CONFIG_BYTES} bytes" in str(info.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, no checkpoint no one could read


def test_a_keep_best_monitor_no_evaluation_reports_is_said_at_the_first_evaluation(tmp_path):
    csf.Run(fixtures.compose("loop.max_steps=4", "loop.eval_every=2", "loop.eval_steps=2",
                             "checkpoint.every_steps=2", "checkpoint.keep_best.monitor=val/los"),
            output_dir=tmp_path).fit()
    warnings = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
                if '"keep_best_monitor_not_reported"' in line]
    assert len(warnings) == 1 and warnings[0]["monitor"] == "val/los" and "val/loss" in warnings[0]["reported"]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002", "step-00000004"]


@pytest.mark.parametrize("monitor, warned", [("train/loss", False), ("train/los", True)])
def test_a_training_monitor_is_checked_once_training_metrics_were_logged(tmp_path, monitor, warned):
    """``keep_best.monitor=train/loss`` was warned as not reported at the first evaluation when no log had come
    yet (``loop.log_every`` after it), though it then kept a best; its check waits for the first training log."""
    csf.Run(fixtures.compose("loop.max_steps=8", "loop.eval_every=2", "loop.eval_steps=2", "loop.log_every=4",
                             "checkpoint.every_steps=2", f"checkpoint.keep_best.monitor={monitor}"),
            output_dir=tmp_path).fit()
    warnings = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
                if '"keep_best_monitor_not_reported"' in line]
    assert len(warnings) == int(warned) and all(w["monitor"] == monitor for w in warnings)


# -- the step's hooks: no call back into the loop (issue 51 item 5) ------------------------------------------
class Nesting:
    """Records each ``on_log_metrics`` dispatched while ``on_train_step_end`` is being dispatched."""

    name = "nesting"

    def __init__(self):
        self.inside, self.nested, self.logged = False, [], []

    @csf.hookimpl(hookwrapper=True)
    def on_train_step_end(self):
        self.inside = True
        yield
        self.inside = False

    @csf.hookimpl
    def on_log_metrics(self, metrics, step):
        if self.inside:
            self.nested.append(step)
        if "train/loss" in metrics:
            self.logged.append(step)


def test_a_checkpoint_step_reports_its_metrics_before_the_steps_hooks_not_inside_them(tmp_path):
    """Before: the checkpoint plugin's save flushed the loop's metrics from inside ``on_train_step_end``."""
    spy = Nesting()
    fit(tmp_path, "loop.max_steps=6", "loop.log_every=4", "checkpoint.every_steps=3", plugins=[spy])
    assert spy.nested == []
    assert spy.logged == [3, 4, 6]  # step 3's checkpoint: the metrics since the last log reported first
    _, meta = read_checkpoint(tmp_path / "checkpoints" / "step-00000003")
    assert meta["metrics"]["train/loss"] > 0


def test_run_flush_metrics_is_deprecated(tmp_path):
    run = csf.Run(fixtures.compose(), output_dir=tmp_path)
    with pytest.warns(DeprecationWarning, match=r"run\.set_save_due"):
        run.flush_metrics()

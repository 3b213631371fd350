"""``csframework.run``, ``Run`` in process: hook order, plugins failing, resume, stages, precision,
clipping, epochs, config errors and the run directory's logs (issue 2); ``run.request_stop`` called in a
loader worker, where the run never sees it, is a ``WrongProcessError``; a plugin's forked child never
finishes the run. Every run is the tiny Blobs/MLP config of ``fixtures``."""
import json
import os
import shutil

import pytest
import torch
from torch.utils.data import Dataset

import csframework as csf
import fixtures
from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from csframework.defaults.tiny import Clusters
from csframework.errors import WrongProcessError
from fixtures import one_line


def fit(tmp_path, *overrides, plugins=()):
    return csf.Run(fixtures.compose(*overrides), plugins=list(plugins), output_dir=tmp_path).fit()


# -- 6. hook order ------------------------------------------------------------------------------------------
def _micro_batch(last: bool) -> list[str]:
    names = ["on_train_batch_start", "on_before_backward", "on_after_backward"]
    return names + (["on_before_optimizer_step"] if last else [])


EVAL_2_BATCHES = ["on_eval_start", "on_eval_epoch_start",
                  "on_eval_batch_start", "on_eval_batch_end",
                  "on_eval_batch_start", "on_eval_batch_end",
                  "on_eval_epoch_end", "on_eval_end"]


def test_hook_order_of_a_run_with_accumulation_eval_logging_and_checkpoints(tmp_path):
    recorder = fixtures.Recorder()
    summary = fit(tmp_path, "loop.max_steps=4", "loop.grad_accum_steps=2", "loop.eval_every=2",
                  "loop.eval_steps=2", "checkpoint.every_steps=2", "loop.log_every=2", plugins=[recorder])
    assert summary["status"] == "completed" and summary["global_step"] == 4

    # One optimizer step = 2 batches. At steps 2 and 4: train metrics are logged, the evaluation runs and
    # logs its metrics, then on_train_batch_end, inside which the checkpoint plugin (trylast) saves.
    step_without_eval = (_micro_batch(False) + ["on_train_batch_end"]
                         + _micro_batch(True) + ["on_train_batch_end"])
    step_with_eval = (_micro_batch(False) + ["on_train_batch_end"]
                      + _micro_batch(True) + ["on_log_metrics"] + EVAL_2_BATCHES + ["on_log_metrics"]
                      + ["on_train_batch_end", "on_checkpoint_save"])
    expected = (["on_fit_start", "on_train_start", "on_train_epoch_start"]
                + step_without_eval + step_with_eval + step_without_eval + step_with_eval
                + ["on_train_epoch_end", "on_train_end", "on_fit_end"])
    assert [name for name, _ in recorder.calls] == expected

    # the steps the hooks saw: the global step advances between on_before_optimizer_step and on_log_metrics
    steps = {name: [s for n, s in recorder.calls if n == name] for name, _ in recorder.calls}
    assert steps["on_before_optimizer_step"] == [0, 1, 2, 3]
    assert steps["on_log_metrics"] == [2, 2, 4, 4]
    assert steps["on_eval_end"] == [2, 4]
    assert steps["on_checkpoint_save"] == [2, 4]
    assert steps["on_train_batch_end"] == [0, 1, 1, 2, 2, 3, 3, 4]
    first_save = recorder.calls.index(("on_checkpoint_save", 2))
    assert recorder.calls.index(("on_eval_end", 2)) < first_save

    # ... so the checkpoint of step 2 holds the metrics of the evaluation of step 2
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    _, meta = read_checkpoint(ckpt)
    rows = [line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    val_at_2 = {name: float(value) for step, _, name, value in rows if step == "2" and name.startswith("val/")}
    assert set(val_at_2) == {"val/loss", "val/accuracy"}
    for name, value in val_at_2.items():
        assert meta["metrics"][name] == pytest.approx(value)


class SeesBuiltins:
    """Checks that in one hook the built-ins ran before this (user) plugin, and the checkpoint save after."""

    name = "sees_builtins"

    def __init__(self):
        self.metrics_csv_at_fit_start = None
        self.checkpoint_existed_at_batch_end = []

    @csf.hookimpl
    def on_fit_start(self, run):
        self.metrics_csv_at_fit_start = (run.output_dir / "metrics.csv").exists()

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.checkpoint_existed_at_batch_end.append(
            (run.output_dir / "checkpoints" / f"step-{run.global_step:08d}").exists())


def test_builtins_run_before_user_plugins_and_checkpoint_saves_after_them(tmp_path):
    plugin = SeesBuiltins()
    fit(tmp_path, "loop.max_steps=2", "checkpoint.every_steps=1", plugins=[plugin])
    assert plugin.metrics_csv_at_fit_start is True  # the metrics plugin's on_fit_start ran first
    assert plugin.checkpoint_existed_at_batch_end == [False, False]  # the save comes after this plugin
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()


# -- 5. plugins that fail -------------------------------------------------------------------------------------
class Explodes:
    name = "explodes"

    def __init__(self):
        self.errors = []

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == 3:
            raise RuntimeError("boom at step 3")

    @csf.hookimpl
    def on_exception(self, run, error):
        self.errors.append(error)


def test_a_plugin_raising_in_a_hook_is_named_and_the_run_fails_cleanly(tmp_path):
    plugin, recorder = Explodes(), fixtures.Recorder()
    with pytest.raises(csf.PluginError) as info:
        fit(tmp_path, "loop.max_steps=6", "checkpoint.every_steps=2", plugins=[plugin, recorder])
    assert "plugin 'explodes' in hook 'on_train_batch_end'" in str(info.value)
    assert "boom at step 3" in str(info.value)
    assert (info.value.plugin, info.value.hook) == ("explodes", "on_train_batch_end")
    # on_exception ran for every plugin, with the error
    assert len(plugin.errors) == 1 and plugin.errors[0] is info.value
    assert recorder.calls[-1] == ("on_exception", 3)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["global_step"] == 3
    assert "explodes" in summary["error"] and "on_train_batch_end" in summary["error"]
    # the last good checkpoint (step 2) is intact; nothing was saved for the failed step
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002"]
    state, meta = read_checkpoint(tmp_path / "checkpoints" / "step-00000002")
    assert meta["stage"] == "main" and state["loop"]["global_step"] == 2


def test_a_plugin_that_fails_to_import_is_named(tmp_path):
    # composition imports plugins.enable (they may declare config sections), so it fails there
    with pytest.raises(csf.PluginError, match=r"plugin 'no.such.module' \(plugins.enable\) failed to load: "
                                              "ModuleNotFoundError"):
        csf.Run(fixtures.compose("plugins.enable=[no.such.module]"), output_dir=tmp_path)
    assert not any(tmp_path.iterdir())


PLUGIN_MODULE = """
import csframework as csf

class Best:
    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        pass

class Unmarked:
    def on_eval_end(self, run, metrics):
        raise RuntimeError("never called")

class NeedsArgs:
    def __init__(self, x):
        pass

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        pass
"""


@pytest.mark.parametrize("path, says", [
    ("plugmod_enable", "plugins.enable: plugmod_enable implements no hook, so it would do nothing; name the class "
                       "that does: plugmod_enable:Best, plugmod_enable:NeedsArgs"),
    ("plugmod_enable:Unmarked", "plugins.enable: plugmod_enable:Unmarked implements no hook, so it would do nothing; "
                                "mark on_eval_end with @csframework.hookimpl"),
    ("plugmod_enable:NeedsArgs", "make it instantiable with no arguments, or remove it from plugins.enable"),
])
def test_a_plugins_enable_entry_that_would_do_nothing_or_cannot_be_made_is_a_bad_config(tmp_path, monkeypatch, path,
                                                                                       says):
    """A module whose hooks are a class's, a class whose hook methods lack ``@hookimpl``: each registered and
    silently did nothing; a class that needs arguments failed with exit 1 and the advice to disable it."""
    (tmp_path / "plugmod_enable.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(csf.CsfError) as refused:
        csf.Run(fixtures.compose(f"plugins.enable=[{path}]"), output_dir=tmp_path / "run")
    assert refused.value.exit_code == 2 and says in str(refused.value)
    csf.Run(fixtures.compose("plugins.enable=[plugmod_enable:Best]"), output_dir=tmp_path / "run")


def test_plugins_disable_turns_off_builtins_and_unknown_names_are_refused(tmp_path):
    summary = fit(tmp_path, "loop.max_steps=2", "plugins.disable=[checkpoint,metrics]")
    assert summary["status"] == "completed"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()
    with pytest.raises(csf.ConfigError, match="plugins.disable: no plugin named nope"):
        csf.Run(fixtures.compose("plugins.disable=[nope]"), output_dir=tmp_path / "x")


# -- 7. resume ------------------------------------------------------------------------------------------------
class StartStep:
    name = "start_step"

    def __init__(self):
        self.at_fit_start = None

    @csf.hookimpl
    def on_fit_start(self, run):
        self.at_fit_start = run.global_step


def test_resume_auto_extends_a_completed_run(tmp_path):
    first = StartStep()
    assert fit(tmp_path, "loop.max_steps=10", plugins=[first])["global_step"] == 10
    assert first.at_fit_start == 0

    second = StartStep()
    summary = fit(tmp_path, "loop.max_steps=20", "checkpoint.resume=auto", plugins=[second])
    assert second.at_fit_start == 10
    assert summary["status"] == "completed" and summary["global_step"] == 20

    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,stage,name,value" and lines.count(lines[0]) == 1
    loss_steps = [int(l.split(",")[0]) for l in lines[1:] if l.split(",")[2] == "train/loss"]
    assert loss_steps == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]  # both parts, log_every=2
    # the continued run is the uninterrupted run: same parameters after 20 steps
    straight = tmp_path / "straight"
    fit(straight, "loop.max_steps=20")
    resumed, _ = read_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
    uninterrupted, _ = read_checkpoint(list_checkpoints(straight / "checkpoints")[-1])
    for name, value in uninterrupted["model"].items():
        torch.testing.assert_close(resumed["model"][name], value, msg=name)


def test_a_checkpoint_holds_the_state_the_backend_hands_out(tmp_path, monkeypatch):
    """``Backend.checkpoint_state``: a backend whose state lives on a device that hands it out only at some
    steps (the Cerebras bridge's checkpoint closure) gives the checkpoint the state it fetched there."""
    from csframework.backends.eager import EagerBackend

    def fetched(self, model, optimizer):
        return {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}, optimizer.state_dict()

    monkeypatch.setattr(EagerBackend, "checkpoint_state", fetched, raising=False)
    fit(tmp_path, "loop.max_steps=2")
    state, _ = read_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
    assert state["model"] and all(bool((v == 7.0).all()) for v in state["model"].values())


# -- 8. stages, precision, clipping, epochs, check --------------------------------------------------------------
class StageWatcher:
    name = "stage_watcher"

    def __init__(self):
        self.lrs = []
        self.params = {}

    @csf.hookimpl
    def on_before_optimizer_step(self, run, optimizer):
        self.lrs.append((run.stage, run.global_step, optimizer.param_groups[0]["lr"]))

    @csf.hookimpl
    def on_train_start(self, run):
        self.params[("start", run.stage)] = [p.detach().clone() for p in run.model.parameters()]

    @csf.hookimpl
    def on_train_end(self, run):
        self.params[("end", run.stage)] = [p.detach().clone() for p in run.model.parameters()]


def test_stages_run_in_order_with_their_own_settings_and_continue_the_weights(tmp_path):
    watcher = StageWatcher()
    summary = fit(tmp_path, "+stages.warm.optimizer.lr=0.1", "+stages.warm.loop.max_steps=3",
                  "+stages.tune.optimizer.lr=0.01", "+stages.tune.loop.max_steps=2", plugins=[watcher])
    assert summary["status"] == "completed" and summary["global_step"] == 5 and summary["stage"] == "tune"
    assert watcher.lrs == [("warm", 0, 0.1), ("warm", 1, 0.1), ("warm", 2, 0.1),
                           ("tune", 3, 0.01), ("tune", 4, 0.01)]
    p = watcher.params
    for a, b in zip(p[("end", "warm")], p[("start", "tune")]):
        assert torch.equal(a, b)  # stage 2 starts from stage 1's weights
    assert not all(torch.equal(a, b) for a, b in zip(p[("start", "warm")], p[("end", "warm")]))
    assert not all(torch.equal(a, b) for a, b in zip(p[("start", "tune")], p[("end", "tune")]))
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    assert {r.split(",")[1] for r in rows} == {"warm", "tune"}


class HalfPrecisionProbe:
    name = "half_precision_probe"

    def __init__(self):
        self.losses, self.dtypes = [], set()

    @csf.hookimpl
    def on_before_backward(self, loss):
        self.losses.append(float(loss.detach()))

    @csf.hookimpl
    def on_train_batch_end(self, outputs):
        self.dtypes.add(outputs["logits"].dtype)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_half_precision_trains_on_cpu(tmp_path, precision):
    probe = HalfPrecisionProbe()
    run = csf.Run(fixtures.compose(f"precision={precision}", "loop.max_steps=12"), plugins=[probe],
                  output_dir=tmp_path)
    summary = run.fit()
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert probe.dtypes == {getattr(torch, precision)}  # the forward ran in half precision
    assert all(p.dtype == torch.float32 for p in run.model.parameters())  # master weights stay float32
    assert torch.isfinite(torch.tensor(probe.losses)).all()
    assert sum(probe.losses[-3:]) < sum(probe.losses[:3])  # and it learns
    scaler = run.backend.precision.scaler
    if precision == "float16":  # dynamic loss scaling
        assert scaler is not None and scaler.is_enabled() and scaler.get_scale() > 1
    else:
        assert scaler is None


def params_of(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


#: float16 with a first loss scale that overflows: the first 6 of 12 steps are skipped, the scale halving each time
OVERFLOWING = ["precision=float16", "precision.init_scale=4194304", "loop.max_steps=12", "optimizer=adamw",
               "optimizer.lr=0.01"]
#: the same AdamW as ``optimizer=adamw``, but the user asked for its unfused implementation
UNFUSED_ADAMW = ["optimizer._target_=torch.optim.AdamW", "+optimizer.args.fused=false"]


def test_loss_scaling_skips_overflowing_steps_on_the_device_as_gradscaler_does_on_the_host(tmp_path):
    """Under dynamic loss scaling torch's AdamW runs fused, and its kernel skips an overflowing step (no
    synchronisation); trained like the unfused AdamW, whose step ``GradScaler`` skips after reading the flag."""
    fused = csf.Run(fixtures.compose(*OVERFLOWING), output_dir=tmp_path / "fused")
    assert fused.fit()["status"] == "completed"
    host = csf.Run(fixtures.compose(*OVERFLOWING, *UNFUSED_ADAMW), output_dir=tmp_path / "host")
    assert host.fit()["status"] == "completed"
    assert all(g["fused"] for g in fused.optimizer.param_groups)
    assert not any(g["fused"] for g in host.optimizer.param_groups), "fused=false is the user's choice: kept"
    assert fused.backend.loss_scale() == host.backend.loss_scale() == 4194304 / 2 ** 6
    for run in (fused, host):  # the skipped steps left the step counts alone: 6 steps were taken
        assert {float(state["step"]) for state in run.optimizer.state.values()} == {6.0}
    a, b = params_of(fused), params_of(host)
    for name in a:  # the fused kernel rounds differently (about 1e-8 here)
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_loss_scaled_run_resumes_exactly_from_a_checkpoint_of_an_unfused_optimizer(tmp_path):
    """A checkpoint written before the optimizer ran fused (its settings say ``fused: None``) resumes fused
    and trains as the uninterrupted run."""
    straight = csf.Run(fixtures.compose(*OVERFLOWING), output_dir=tmp_path / "straight")
    straight.fit()
    first = csf.Run(fixtures.compose(*OVERFLOWING[:-2], "loop.max_steps=6", "optimizer=adamw", "optimizer.lr=0.01"),
                    output_dir=tmp_path / "first")
    first.fit()
    state = first.state_dict()
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = None
    resumed = csf.Run(fixtures.compose(*OVERFLOWING), output_dir=tmp_path / "resumed")
    resumed.load_state_dict(state)
    assert all(g["fused"] for g in resumed.optimizer.param_groups)
    assert resumed.fit()["global_step"] == 12
    a, b = params_of(straight), params_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.backend.loss_scale() == straight.backend.loss_scale()


class ClipProbe:
    name = "clip_probe"

    @csf.hookimpl
    def on_before_optimizer_step(self, run, optimizer):
        self.before = [p.detach().clone() for p in run.model.parameters()]
        self.grads = [p.grad.detach().clone() for p in run.model.parameters()]

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.after = [p.detach().clone() for p in run.model.parameters()]


def test_gradient_clipping_scales_the_sgd_update_to_max_grad_norm(tmp_path):
    probe = ClipProbe()
    lr, max_norm = 0.5, 0.05
    fit(tmp_path, "loop.max_steps=1", "optimizer=sgd", f"optimizer.lr={lr}", "optimizer.momentum=0",
        f"optimizer.max_grad_norm={max_norm}", plugins=[probe])
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in probe.grads]))
    assert norm > 4 * max_norm  # clipping really changes this step
    coef = max_norm / (norm + 1e-6)
    for before, grad, after in zip(probe.before, probe.grads, probe.after):
        torch.testing.assert_close(after, before - lr * coef * grad)
    update = torch.linalg.vector_norm(torch.cat([(b - a).flatten() for b, a in zip(probe.before, probe.after)]))
    assert update == pytest.approx(lr * max_norm, rel=1e-4)


def test_max_epochs_runs_whole_epochs(tmp_path):
    recorder = fixtures.Recorder()
    summary = fit(tmp_path, "loop.max_steps=null", "loop.max_epochs=2", plugins=[recorder])
    assert summary["global_step"] == 2 * (256 // 16)
    names = [n for n, _ in recorder.calls]
    assert names.count("on_train_epoch_start") == names.count("on_train_epoch_end") == 2
    assert names.count("on_before_optimizer_step") == 32


def test_check_mode_builds_and_trains_nothing(tmp_path):
    recorder = fixtures.Recorder()
    run = csf.Run(fixtures.compose("mode=check"), plugins=[recorder], output_dir=tmp_path / "run")
    before = [p.detach().clone() for p in run.model.parameters()]
    result = run.check()
    assert result["status"] == "checked" and result["device_type"] == "CPU"
    assert recorder.calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters()))
    assert not (tmp_path / "run").exists()


# -- 8. config errors name the full key ---------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("loop.max_stepz=5", "loop.max_stepz"),                                 # unknown key
    ("+optimizer.schedule.warmup=3", "optimizer.schedule.warmup"),          # unknown nested key
    ("optimizer.lr=abc", "optimizer.lr"),                                   # wrong type
    ("optimizer.schedule.warmup_steps=x", "optimizer.schedule.warmup_steps"),
    ("optimizer.schedule.name=expo", "optimizer.schedule.name"),            # not one of the choices
    ("data.train=???", "data.train"),                                       # missing required value
    ("~model", "model"),
    ("precision=fp8", "precision"),                                         # no such group option
])
def test_compose_errors_name_the_full_key(override, key):
    with pytest.raises(csf.ConfigError) as info:
        fixtures.compose(override)
    assert str(info.value).startswith(f"{key}: "), str(info.value)
    assert info.value.exit_code == 2


def test_a_typo_in_a_user_config_file_names_the_key(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(fixtures.CONF, conf)
    (conf / "data" / "typo.yaml").write_text("defaults:\n  - blobs\n  - _self_\nbatch_sise: 8\n")
    with pytest.raises(csf.ConfigError, match=r"^data\.batch_sise: "):
        csf.compose(["model=blobs_mlp", "data=typo"], config_dir=str(conf))


# -- the run directory's logs ---------------------------------------------------------------------------------
def test_events_jsonl_lines_carry_run_id_stage_and_step(tmp_path):
    summary = fit(tmp_path, "loop.max_steps=4", "+stages.a.loop.max_steps=2", "+stages.b.loop.max_steps=2")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events, "events.jsonl is empty"
    for event in events:
        assert event["run_id"] == summary["run_id"]
        assert event["stage"] in ("a", "b") and isinstance(event["step"], int) and "event" in event
    names = [e["event"] for e in events]
    assert names[0] == "fit_start" and names[-1] == "fit_end"
    metrics = [(e["stage"], e["step"]) for e in events if e["event"] == "metrics" and "train/loss" in e]
    assert metrics == [("a", 2), ("b", 4)]


class LogsAtTheEnd:
    """Logs through ``run.log`` in the last hooks of a run, as a user's reporting plugin does."""

    name = "logs_at_the_end"

    @csf.hookimpl
    def on_fit_end(self, run):
        run.log.info("my_report", best=1.0)

    @csf.hookimpl
    def on_exception(self, run, error):
        run.log.warning("my_cleanup", error=type(error).__name__)


def test_plugins_can_log_in_on_fit_end_and_on_exception(tmp_path):
    run = csf.Run(fixtures.compose("loop.max_steps=2"), plugins=[LogsAtTheEnd()], output_dir=tmp_path / "ok")
    assert run.fit()["status"] == "completed"
    names = [json.loads(line)["event"] for line in (tmp_path / "ok" / "events.jsonl").read_text().splitlines()]
    assert names[-2:] == ["my_report", "fit_end"]  # the logging plugin closes its file last
    run.log.info("after_the_run")  # still usable (console only) once the run is over

    with pytest.raises(csf.PluginError, match="plugin 'explodes' in hook 'on_train_batch_end'"):
        fit(tmp_path / "failed", "loop.max_steps=4", plugins=[Explodes(), LogsAtTheEnd()])
    events = [json.loads(line) for line in (tmp_path / "failed" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-2:] == ["my_cleanup", "fit_failed"]
    assert events[-2]["error"] == "PluginError"


# -- a plugin's forked child --------------------------------------------------------------------------------

def test_a_plugins_forked_child_does_not_run_the_runs_failure_or_completion_paths(tmp_path):
    class Forker:
        name = "forker"

        @csf.hookimpl
        def on_train_batch_end(self, run):
            if run.global_step == 2 and os.fork() == 0:
                raise SystemExit(0)  # the child comes back into the run instead of calling os._exit

    summary = csf.Run(fixtures.compose("loop.max_steps=4"), plugins=[Forker()], output_dir=tmp_path).fit()
    os.waitpid(-1, 0)  # the child has ended (it exits at once) before summary.json is read
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == on_disk["status"] == "completed" and on_disk["global_step"] == 4
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "fit_failed" not in events and events.count("fit_end") == 1


# -- request_stop from a loader worker (issue 27, item 6) ---------------------------------------------------
class Stopping(Dataset):
    """A dataset that asks its run to stop when it reads a sample (``HandsRun`` gives it the run)."""

    run = None

    def __init__(self, **kwargs):
        self.data = Clusters(**kwargs)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if Stopping.run is not None:
            Stopping.run.request_stop("enough data")
        return self.data[i]


class HandsRun:
    name = "hands_run"

    @csf.hookimpl
    def on_fit_start(self, run):
        Stopping.run = run


@pytest.fixture
def stopping():
    yield [f"data.train._target_={__name__}.Stopping"]
    Stopping.run = None


def test_request_stop_in_a_loader_worker_is_refused_naming_it(runner, stopping):
    result = runner.run([*stopping, "data.num_workers=1"], plugins=[HandsRun()])
    assert result.exit_code == 1 and isinstance(result.error, WrongProcessError), result.error
    message = one_line(result.error)
    assert message.startswith("run.request_stop('enough data') was called in process ")
    assert "(a data-loader worker or another child process), where the run would never see it" in message
    assert result.summary.get("status") == "failed" and "stop_reason" not in result.summary


def test_request_stop_in_the_runs_process_still_stops_it(runner, stopping):
    result = runner.run([*stopping, "data.num_workers=0"], plugins=[HandsRun()])
    assert result.exit_code == 0, result.error
    assert result.summary["stop_reason"] == "enough data" and result.summary["global_step"] == 1


def test_run_takes_a_run_config_and_says_how_to_make_one():
    """Composition is api's (csf.compose): Run is handed its result, not overrides to compose itself."""
    import re

    from omegaconf import OmegaConf

    for given, advice in ((["loop.max_steps=2"], "csf.compose"), (None, "csf.compose"),
                          (OmegaConf.create({"loop": {}}), "csframework.api.to_run_config")):
        with pytest.raises(TypeError, match=f"Run takes a RunConfig, not .*: make one with {re.escape(advice)}"):
            csf.Run(given)


# -- issue 42: the run holds a Stage; the plugin manager composition built ---------------------------------
class StageParts:
    """Records, at each stage's start, the run's parts and whether the previous stage's loaders were closed."""

    name = "stage_parts"

    def __init__(self):
        self.seen = []

    @csf.hookimpl
    def on_train_start(self, run):
        self.seen.append((run.stage, run.current, run.backend, run.optimizer, run.train_loader))


def test_each_stage_is_built_whole_and_the_run_reads_its_parts_from_it(tmp_path, monkeypatch):
    from csframework.data import FrameworkLoader
    from csframework.stage import Stage

    closed = []
    monkeypatch.setattr(FrameworkLoader, "close", lambda loader: closed.append(loader))
    parts = StageParts()
    fit(tmp_path, "+stages.warm.loop.max_steps=2", "+stages.tune.loop.max_steps=1", plugins=[parts])
    (warm, warm_stage, *_), (tune, tune_stage, backend, optimizer, train_loader) = parts.seen
    assert (warm, tune) == ("warm", "tune") and isinstance(tune_stage, Stage) and warm_stage is not tune_stage
    assert (backend, optimizer, train_loader) == (tune_stage.backend, tune_stage.optimizer, tune_stage.train_loader)
    assert all(part is not None for part in vars(tune_stage).values())  # no part left to be set later
    assert warm_stage.train_loader in closed  # entering a stage releases the previous one's loaders


def test_a_backend_may_replace_the_stages_optimizer_and_schedule_in_attach(tmp_path):
    run = csf.Run(fixtures.compose(), output_dir=tmp_path)
    optimizer = torch.optim.SGD(run.model.parameters(), lr=0.5)
    run.optimizer, run.scheduler = optimizer, "a backend's schedule"
    assert run.current.optimizer is optimizer and run.current.scheduler == "a backend's schedule"


def test_the_cli_hands_the_run_the_plugin_manager_its_composition_built(tmp_path):
    from csframework import api

    found = api.command_line_composition(["plugins.disable=[progress]"], for_run=True)
    config = fixtures.compose("plugins.disable=[progress]")
    manager = found.run_manager(config)
    assert manager is found.manager
    assert csf.Run(config, output_dir=tmp_path, manager=manager).hooks.pm is manager
    # a manager asked for composition only, or for other plugins than the config's, is not the run's
    assert api.command_line_composition(["plugins.disable=[progress]"]).run_manager(config) is None
    assert found.run_manager(fixtures.compose()) is None

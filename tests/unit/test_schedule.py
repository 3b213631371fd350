"""``csframework.schedule``: the built-in learning-rate schedules, and any optimizer and learning-rate
scheduler by ``_target_``: built with the arguments it takes, checked before launch, stepped per optimizer
step or per epoch, resumed exactly; on CSX only preinitialisable ones."""
import sys

import pytest
import torch

import csframework as csf
import fixtures
from csframework.config import OptimizerConfig
from csframework.config.stages import stage_config
from csframework.errors import ValidationError
from csframework.schedule import optimizer_spec, schedule_spec

RMSPROP = ["optimizer._target_=torch.optim.RMSprop", "optimizer.args.alpha=0.9"]
STEP_LR = ["optimizer.schedule._target_=torch.optim.lr_scheduler.StepLR", "optimizer.schedule.args.step_size=3",
           "optimizer.schedule.args.gamma=0.5"]


class SignSGD(torch.optim.Optimizer):
    """A user's optimizer whose state (a step counter) is created up front, so it can run on CSX."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    def preinitialize(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("count", torch.zeros(()))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad) * -group["lr"])
                    self.state[p]["count"].add_(1)


def fit(tmp_path, *overrides, name="run"):
    run = csf.Run(fixtures.compose(*overrides), output_dir=tmp_path / name)
    return run, run.fit()


def test_rmsprop_and_steplr_build_as_written_and_step_once_per_optimizer_step(tmp_path):
    run, summary = fit(tmp_path, "optimizer=adamw", "optimizer.lr=0.08", *RMSPROP, *STEP_LR)
    assert summary["status"] == "completed"
    assert type(run.optimizer) is torch.optim.RMSprop
    defaults = run.optimizer.defaults
    # taken from the group (lr, weight_decay, eps) and args (alpha); adamw's betas are not passed
    assert (defaults["lr"], defaults["alpha"], defaults["weight_decay"]) == (0.08, 0.9, 0.01)
    assert isinstance(run.scheduler.scheduler, torch.optim.lr_scheduler.StepLR)
    # 8 optimizer steps, halved every 3: 0.08 * 0.5 ** 2
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.02)


def test_a_schedule_per_epoch_steps_at_epoch_ends(tmp_path):
    # 256 samples / batch 64: 4 steps per epoch; 10 steps end two epochs
    run, _ = fit(tmp_path, "data.batch_size=64", "loop.max_steps=10", *STEP_LR,
                 "optimizer.schedule.args.step_size=1", "optimizer.schedule.interval=epoch")
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


@pytest.mark.parametrize("schedule", [STEP_LR, STEP_LR + ["optimizer.schedule.args.step_size=1",
                                                           "optimizer.schedule.interval=epoch"]],
                         ids=["per_step", "per_epoch"])
def test_resume_from_the_middle_is_exact(tmp_path, schedule):
    common = ["data.batch_size=64", "loop.max_steps=10", "checkpoint.every_steps=5", *RMSPROP, *schedule]
    straight, _ = fit(tmp_path, *common, name="straight")
    half = tmp_path / "straight" / "checkpoints" / "step-00000005"
    assert half.is_dir()
    resumed, summary = fit(tmp_path, *common, f"checkpoint.resume={half}", name="resumed")
    assert summary["global_step"] == 10
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("overrides, message", [
    (RMSPROP + ["optimizer.betas=[0.5,0.5]"], "optimizer.betas: torch.optim.RMSprop does not take 'betas'"),
    (RMSPROP + ["optimizer.args.gamma=1"], "optimizer.args.gamma: torch.optim.RMSprop does not take 'gamma'"),
    (["optimizer._target_=torch.optim.NoSuchOptimizer"],
     "optimizer._target_: torch.optim.NoSuchOptimizer: module 'torch.optim' has no 'NoSuchOptimizer'"),
    (["optimizer.schedule._target_=torch.optim.lr_scheduler.StepLR"],
     "optimizer.schedule.args.step_size: torch.optim.lr_scheduler.StepLR needs it"),
    (STEP_LR + ["optimizer.schedule.warmup_steps=5"], "optimizer.schedule.warmup_steps: only the built-in"),
    (["optimizer.momentum=0.5", "optimizer=adamw"], "optimizer.momentum: only sgd understands it"),
])
def test_an_argument_the_class_does_not_take_is_rejected_before_launch(tmp_path, overrides, message):
    with pytest.raises(ValidationError) as caught:
        csf.Run(fixtures.compose(*overrides), output_dir=tmp_path / "rejected")
    assert caught.value.exit_code == 2
    assert any(p.startswith(message) for p in caught.value.problems), caught.value.problems
    assert not (tmp_path / "rejected").exists()


def test_an_unknown_key_of_a_builtin_optimizer_is_still_an_error():
    with pytest.raises(csf.ConfigError, match="optimizer.alpha"):
        fixtures.compose("optimizer.alpha=0.9")


def test_csx_rejects_an_optimizer_that_cannot_be_preinitialised(tmp_path):
    with pytest.raises(ValidationError) as caught:
        csf.Run(fixtures.compose("device=csx", *RMSPROP), output_dir=tmp_path / "rejected")
    assert caught.value.problems[0].startswith("optimizer._target_: torch.optim.RMSprop cannot run on device=csx")


@pytest.mark.parametrize("precision", ["float32", "cbfloat16"])
def test_csx_trains_a_preinitialised_custom_optimizer(tmp_path, precision):
    run, summary = fit(tmp_path, "device=csx", f"precision={precision}", "loop.max_steps=4",
                       f"optimizer._target_={__name__}.SignSGD", "optimizer=adamw", *STEP_LR)
    assert summary["status"] == "completed" and summary["traces"] == 1
    counts = {int(s["count"]) for s in run.optimizer.state.values()}
    assert counts == {4} or precision == "cbfloat16" and max(counts) <= 4


# -- which settings the user set: Hydra's record of the overrides, not the group's file read again -------------
RPROP = ["optimizer=adamw", "optimizer._target_=torch.optim.Rprop"]  # Rprop takes lr, not weight_decay/betas/eps


def test_the_groups_defaults_a_class_does_not_take_are_left_out_without_its_file(monkeypatch):
    config = fixtures.compose(*RPROP, *STEP_LR)
    monkeypatch.setitem(sys.modules, "csframework.conf", None)  # a source tree that is not installed
    cls, kwargs = optimizer_spec(config.optimizer)  # adamw's weight_decay=0.01, betas, eps: not the user's
    assert cls is torch.optim.Rprop and kwargs == {"lr": 0.1}  # TINY's lr
    assert schedule_spec(config.optimizer)[1] == {"step_size": 3, "gamma": 0.5}  # adamw's cosine schedule too


@pytest.mark.parametrize("override, spec, message", [
    ("optimizer.weight_decay=0.01", optimizer_spec, "optimizer.weight_decay: torch.optim.Rprop does not take"),
    ("optimizer.schedule.name=cosine", schedule_spec, "optimizer.schedule.name: only the built-in schedules"),
    ("optimizer.schedule={name: cosine}", schedule_spec, "optimizer.schedule.name: only the built-in schedules"),
])
def test_an_explicit_value_equal_to_the_groups_default_counts_as_set(override, spec, message):
    config = fixtures.compose(*RPROP, *STEP_LR, override)
    with pytest.raises(csf.ConfigError, match=message):
        spec(config.optimizer)


def test_a_stages_optimizer_setting_counts_as_set_there_only():
    config = fixtures.compose(*RPROP)
    stage = stage_config(config, "b", {"optimizer": {"weight_decay": 0.01, "schedule": {"min_lr": 0.0}}})
    assert stage.optimizer.is_set("weight_decay") and stage.optimizer.is_set("schedule.min_lr")
    assert not stage.optimizer.is_set("eps") and not config.optimizer.is_set("weight_decay")
    with pytest.raises(csf.ConfigError, match="optimizer.weight_decay: torch.optim.Rprop does not take"):
        optimizer_spec(stage.optimizer)


def test_without_a_builtin_option_a_value_other_than_the_schemas_is_the_users(tmp_path):
    built = OptimizerConfig(_target_="torch.optim.Rprop", lr=0.01)  # in Python: every value is the user's
    assert optimizer_spec(built)[1] == {"lr": 0.01}
    with pytest.raises(csf.ConfigError, match="optimizer.weight_decay"):
        optimizer_spec(OptimizerConfig(_target_="torch.optim.Rprop", weight_decay=0.1))
    (tmp_path / "optimizer").mkdir()  # the user's own option file
    (tmp_path / "optimizer" / "mine.yaml").write_text("_target_: torch.optim.Rprop\nweight_decay: 0.1\n")
    config = csf.compose(["optimizer=mine"], config_dir=str(tmp_path))
    with pytest.raises(csf.ConfigError, match="optimizer.weight_decay"):
        optimizer_spec(config.optimizer)


# -- the built-in schedules ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # after the warm-up the decay starts at the peak and ends at min_lr on the last of the 8 steps
    ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 1 - 0.8 / 3, 1 - 1.6 / 3, 0.2]),
    ("cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.775, 0.325, 0.1]),  # 0.1 + 0.9 * (1 + cos(pi k/3)) / 2
])
def test_schedule_warms_up_then_decays_to_min_lr_at_the_last_step_and_resumes(name, expected):
    from csframework.config import OptimizerConfig, ScheduleConfig
    from csframework.schedule import build_scheduler

    min_lr = 0.2 if name == "linear" else 0.1
    cfg = OptimizerConfig(lr=1.0, schedule=ScheduleConfig(name=name, warmup_steps=4, min_lr=min_lr))
    param = torch.nn.Parameter(torch.zeros(1))

    def optimizer():
        return torch.optim.SGD([param], lr=cfg.lr)

    opt = optimizer()
    schedule = build_scheduler(opt, cfg, total_steps=8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])  # the rate the optimizer step uses
        schedule.step()
    assert seen == pytest.approx(expected)
    assert schedule.get_last_lr() == [opt.param_groups[0]["lr"]]

    # a resumed run (fresh optimizer, state loaded after 5 steps) continues with the same rates
    again = build_scheduler(opt := optimizer(), cfg, total_steps=8)
    replay = build_scheduler(optimizer(), cfg, total_steps=8)
    for _ in range(5):
        replay.step()
    again.load_state_dict(replay.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(expected[5])
    # and a torch LambdaLR state (the format of earlier checkpoints) loads the same way
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda step: 1.0)
    for _ in range(5):
        lambda_lr.optimizer.step()
        lambda_lr.step()
    again.load_state_dict(lambda_lr.state_dict())
    assert again.last_epoch == 5 and opt.param_groups[0]["lr"] == pytest.approx(expected[5])


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_the_rate_stops_being_written_only_once_it_no_longer_changes(name):
    """``Schedule.step`` skips its work once the factor is settled: at every step, over short and long
    schedules, with and without warm-up and a zero rate, the rate is still ``lr * lr_factor(step)``."""
    from csframework.config import OptimizerConfig, ScheduleConfig
    from csframework.schedule import build_scheduler, lr_factor

    for warmup in (0, 1, 3):
        for total in (1, 2, 3, 4, 9):
            for lr in (0.0, 1e-3):
                cfg = OptimizerConfig(lr=lr, schedule=ScheduleConfig(name=name, warmup_steps=warmup, min_lr=1e-4))
                opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
                schedule = build_scheduler(opt, cfg, total_steps=total)
                for step in range(total + 3):
                    assert opt.param_groups[0]["lr"] == pytest.approx(lr * lr_factor(step, cfg, total)), (
                        warmup, total, lr, step)
                    schedule.step()


def test_a_constant_rate_is_written_once_and_loaded_base_rates_replace_it():
    """The constant schedule leaves the rate alone between steps, but a state with other base rates (a
    checkpoint of a run with another optimizer.lr) still sets them, even with the factor unchanged."""
    from csframework.config import OptimizerConfig, ScheduleConfig
    from csframework.schedule import build_scheduler

    cfg = OptimizerConfig(lr=0.5, schedule=ScheduleConfig(name="constant", warmup_steps=0))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = build_scheduler(opt, cfg, total_steps=4)
    schedule.step()
    assert opt.param_groups[0]["lr"] == 0.5
    schedule.load_state_dict({"last_epoch": 2, "base_lrs": [0.125]})
    assert opt.param_groups[0]["lr"] == 0.125 and schedule.get_last_lr() == [0.125]
    schedule.step()
    assert opt.param_groups[0]["lr"] == 0.125


def test_a_resumed_schedule_goes_on_as_saved_whatever_the_new_plan():
    """A checkpoint's schedule state carries its plan: a run resumed with another length, warm-up, kind or
    rate follows the saved schedule step for step, and past its planned steps stays at its final rate
    (no jump back up); a state without a plan (an older checkpoint) keeps the new run's."""
    from csframework.config import OptimizerConfig, ScheduleConfig
    from csframework.schedule import build_scheduler

    def rates(schedule, opt, steps):
        seen = []
        for _ in range(steps):
            seen.append(opt.param_groups[0]["lr"])
            schedule.step()
        return seen

    saved = OptimizerConfig(lr=3e-3, schedule=ScheduleConfig(name="cosine", warmup_steps=30, min_lr=3e-4))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=saved.lr)
    straight = build_scheduler(opt, saved, total_steps=40)
    planned = rates(straight, opt, 40)
    for new in (saved, OptimizerConfig(lr=1e-2, schedule=ScheduleConfig(name="linear", warmup_steps=5, min_lr=0.0))):
        replay = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=saved.lr), saved, 40)
        rates(replay, replay.optimizer, 20)
        resumed = build_scheduler(opt := torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=new.lr), new, 80)
        resumed.load_state_dict(replay.state_dict())
        assert rates(resumed, opt, 60) == pytest.approx(planned[20:] + [3e-4] * 40)
    older = {k: v for k, v in straight.state_dict().items() if k != "plan"}
    resumed = build_scheduler(opt := torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=saved.lr), saved, 80)
    resumed.load_state_dict(older)
    assert opt.param_groups[0]["lr"] > 1e-3  # the 80-step cosine at step 40: the older checkpoints' behaviour


def test_an_unreadable_plan_in_a_checkpoint_is_refused():
    from csframework.config import OptimizerConfig
    from csframework.schedule import build_scheduler

    schedule = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), OptimizerConfig(), 8)
    state = schedule.state_dict()
    for plan in ({**state["plan"], "name": "zigzag"}, {**state["plan"], "total_steps": None}, {"lr": 0.1}):
        with pytest.raises(ValueError, match="schedule's plan is unreadable"):
            schedule.load_state_dict({**state, "plan": plan})


def test_a_relative_floor_follows_the_rate_and_resumes_bit_for_bit():
    """Issue 49 item 10: ``min_lr_ratio`` decays to that fraction of the rate; a checkpoint's plan keeps the
    ratio itself (``lr * ratio / lr`` need not be the ratio), and an older plan's absolute ``min_lr`` stays
    absolute."""
    from csframework.config import OptimizerConfig, ScheduleConfig
    from csframework.schedule import build_scheduler

    def rates(schedule, opt, steps):
        seen = []
        for _ in range(steps):
            seen.append(opt.param_groups[0]["lr"])
            schedule.step()
        return seen

    def sgd(lr):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)

    cfg = OptimizerConfig(lr=3e-3, schedule=ScheduleConfig(name="cosine", warmup_steps=3, min_lr_ratio=0.1))
    straight = build_scheduler(opt := sgd(cfg.lr), cfg, total_steps=20)
    planned = rates(straight, opt, 20)
    assert planned[-1] == 3e-3 * 0.1  # the floor is the ratio of the rate, computed as the factor 0.1
    replay = build_scheduler(opt := sgd(cfg.lr), cfg, 20)
    rates(replay, opt, 8)
    state = replay.state_dict()
    assert state["plan"]["min_lr_ratio"] == 0.1 and state["plan"]["min_lr"] == pytest.approx(3e-4)
    other = OptimizerConfig(lr=1e-2, schedule=ScheduleConfig(name="linear", min_lr=0.0))
    resumed = build_scheduler(opt := sgd(other.lr), other, 20)
    resumed.load_state_dict(state)
    assert rates(resumed, opt, 12) == planned[8:]  # bit for bit
    older = {**state, "plan": {k: v for k, v in state["plan"].items() if k != "min_lr_ratio"}}
    resumed = build_scheduler(opt := sgd(other.lr), other, 20)
    resumed.load_state_dict(older)
    assert rates(resumed, opt, 12)[-1] == pytest.approx(3e-4)


def test_the_resume_warning_states_the_rates_a_warm_up_longer_than_the_plan_gives(tmp_path):
    """A 20-step run with a 20-step warm-up (cosine down to min_lr), resumed to 30: past its plan the rate is
    the warm-up's top for one step, then the floor. The warning said it "stays at its final 0.01"; it states
    the rates the run then logs."""
    import csv

    schedule = ["optimizer.lr=0.01", "optimizer.schedule.name=cosine", "optimizer.schedule.warmup_steps=20",
                "optimizer.schedule.min_lr=0.001", "loop.log_every=1"]
    fixtures.fit(tmp_path, *schedule, "loop.max_steps=20")
    fixtures.fit(tmp_path, *schedule, "loop.max_steps=30", "checkpoint.resume=auto")
    (warning,) = [e for e in fixtures.events(tmp_path) if e["event"] == "resume_settings_changed"]
    assert "from step 20 to 30 the rate goes from 0.01 to 0.001" in warning["problem"]
    with open(tmp_path / "metrics.csv", newline="") as f:
        lr = {int(r["step"]): float(r["value"]) for r in csv.DictReader(f) if r["name"] == "lr"}
    # (the rate logged at a step is the next step's: step 21 trains at 0.01, every later one at 0.001)
    assert lr[20] == pytest.approx(0.01) and lr[21] == lr[30] == pytest.approx(0.001)

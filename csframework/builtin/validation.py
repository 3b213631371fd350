"""The validation plugin: rejects bad runs before anything is built (DESIGN section 4).

Every rule returns problem lines that name the key and say how to fix it; all are reported together.
Every number is range-checked with ``check_range`` (NaN and infinities included) before anything is built.
These are the rules of the core; each backend plugin validates its own settings (``backends/eager.py``,
``backends/csx/schema.py``), and composition refuses a backend setting of another device type.
"""
from __future__ import annotations

import math
import os

from ..config import FIELDS_BY_OPTIMIZER, PRECISIONS, RunConfig, for_each_stage, stage_config, stage_configs
from ..config.ranges import (MAX_COUNT, MAX_FLOAT32, MAX_GROWTH_INTERVAL, MAX_PARALLEL, MAX_SCALE,  # noqa: F401
                             MAX_SEED, MAX_MEMORY_MB, MAX_TIMEOUT_S, check_range)
from ..config.optimizer import param_group_configs
from ..config.sections import eval_sets, test_set_key, test_sets
from ..console_once import first_time
from ..errors import ConfigError
from ..hookspecs import hookimpl
from ..schedule import optimizer_spec, schedule_spec


@hookimpl
def csframework_validate(config: RunConfig) -> list[str]:
    problems = device_choice(config)
    for name, partial in config.stages.items():
        if not stage_name_ok(str(name)):
            problems.append(f"stages.{name}: a stage's name is part of file names (its compile report); give it a "
                            "name without '/', '\\' or control characters, and not '.' or '..'")
            continue
        try:
            stage_config(config, name, partial)
        except ConfigError as e:  # a stage that does not merge (the other rules skip it)
            problems.append(str(e))
    skip = bool(problems)  # when both groups chose the device, that is the one problem to report of it
    problems += for_each_stage(config, lambda cfg: run_rules(cfg, skip_device_pair=skip and cfg is config))
    return problems + across_stages(config, stage_configs(config)) + metrics_rules(config)


def metrics_rules(config: RunConfig) -> list[str]:
    """The ``metrics:`` section needs its plugin (``eval_metrics``, which checks each entry) and a set to
    evaluate (in some stage)."""
    if not config.metrics:
        return []
    if "eval_metrics" in config.plugins.disable:
        return ["metrics: the eval_metrics plugin that computes them is disabled (plugins.disable); remove "
                "eval_metrics from plugins.disable, or remove metrics"]
    if not any(eval_sets(cfg.data) for _, cfg in [("", config), *stage_configs(config)]):
        return ["metrics: they are computed over evaluation sets, and this run has none; set data.val (or "
                "data.eval), or remove metrics"]
    return []


@hookimpl
def on_train_start(run) -> None:
    """Warn (not refuse: a short trial run is legitimate) when the learning-rate warm-up is longer than the
    stage's training, so the rate never reaches ``optimizer.lr``, naming the setting and a value that works
    (a tenth of the stage; for a resumed stage, in a new run: it keeps its checkpoint's schedule). Usually the
    optimizer's default warm-up meeting a shortened run: in a sweep the console shows it once
    (``console_once.first_time``), every job's ``events.jsonl`` records it."""
    cfg = run.stage_config
    plan = getattr(run.scheduler, "cfg", cfg.optimizer)  # the built-in schedule's: warmup_epochs resolved
    warmup, steps = plan.schedule.warmup_steps, run.total_steps(cfg)
    if warmup > steps:
        length = (f"loop.max_steps ({steps})" if cfg.loop.max_steps is not None
                  else f"loop.max_epochs ({cfg.loop.max_epochs}, {steps} steps)")
        run.log.warning("warmup_longer_than_training", warmup_steps=warmup, steps=steps,
                        problem=f"optimizer.schedule.warmup_steps ({warmup}) is longer than {length}: the "
                                "learning rate never reaches optimizer.lr",
                        fix=(("a resumed run keeps its checkpoint's schedule: in a new run, " if run.stage_step else "")
                             + f"set optimizer.schedule.warmup_steps={steps // 10} (any value up to {steps} works)"),
                        console=first_time("warmup_longer_than_training"))


def stage_name_ok(name: str) -> bool:
    """Whether ``name`` can be one component of a file name on every system (a stage's compile report)."""
    return bool(name) and name not in (".", "..") and not any(c in "/\\" or ord(c) < 32 for c in name)


def device_choice(cfg: RunConfig) -> list[str]:
    """DESIGN 4.2: ``device`` and ``backend`` are mutually exclusive ways to choose the device."""
    if {"device", "backend"} <= set(cfg.selected):
        backend = getattr(cfg.backend, "name", None) or cfg.backend.type.lower()
        return [f"device, backend: both choose the device (device={cfg.device.type.lower()}, "
                f"backend={backend}); they are mutually exclusive: choose it with "
                "device=<type> and tune it with backend.<field>=<value>, or use backend=<type> alone"]
    return []


def run_rules(cfg: RunConfig, skip_device_pair: bool = False) -> list[str]:
    """The core rules of one (stage) config (composition already checked the device and backend types)."""
    problems = device_rules(cfg, skip_device_pair)
    return (problems + precision_rules(cfg) + optimizer_rules(cfg) + loop_rules(cfg) + data_rules(cfg)
            + checkpoint_rules(cfg) + check_range("seed", cfg.seed, 0, MAX_SEED,
                                                  hint=" (the range of every generator seeded from it)"))


def device_rules(cfg: RunConfig, skip_device_pair: bool = False) -> list[str]:
    kind, backend = cfg.device.type, cfg.backend.type
    # a named backend's ``type`` is its own setting (composition matched its device type already)
    if backend != kind and not skip_device_pair and getattr(cfg.backend, "name", None) is None:
        return [f"device, backend.type: the backend is {backend} but the device is {kind}; "
                f"set only one of them (device={kind.lower()} picks its own backend)"]
    return []


def precision_rules(cfg: RunConfig) -> list[str]:
    """DESIGN 4.6: what each precision needs."""
    p = cfg.precision
    if p.name not in PRECISIONS:
        return [f"precision.name: '{p.name}' is not a precision; use one of {', '.join(PRECISIONS)}"]
    problems = []
    scaling = p.loss_scaling
    if scaling not in (None, "none", "dynamic"):
        try:
            problems += check_range("precision.loss_scaling", float(scaling), 0.0, MAX_SCALE, open_low=True,
                                    hint=", dynamic or null")
        except (TypeError, ValueError):
            problems.append(f"precision.loss_scaling: '{scaling}' is not dynamic, null or a positive number")
    if p.name == "cbfloat16":  # which device it needs is the CSX plugin's rule
        if scaling != "dynamic":
            problems.append("precision.loss_scaling: cbfloat16 needs dynamic loss scaling; set it to dynamic")
    if p.name == "float16" and scaling in (None, "none"):
        problems.append("precision.loss_scaling: float16 needs loss scaling; set it to dynamic")
    if p.name in ("float32", "bfloat16") and scaling not in (None, "none"):
        problems.append(f"precision.loss_scaling: {p.name} does not use loss scaling; set it to null")
    scales = (check_range("precision.init_scale", p.init_scale, 0.0, MAX_SCALE, open_low=True)
              + check_range("precision.min_scale", p.min_scale, 0.0, MAX_SCALE, open_low=True))
    if not scales and p.min_scale > p.init_scale:
        scales.append(f"precision.min_scale: {p.min_scale} must be <= precision.init_scale ({p.init_scale})")
    return (problems + scales
            + check_range("precision.growth_interval", p.growth_interval, 1, MAX_GROWTH_INTERVAL))


#: Why the optimizer's settings are bounded by float32's largest number.
IN_FLOAT32 = " (float32's largest number: the optimizer's update computes in float32)"


def optimizer_rules(cfg: RunConfig) -> list[str]:
    o = cfg.optimizer
    name = getattr(o.name, "value", o.name)
    problems = (target_rules(cfg) + check_range("optimizer.lr", o.lr, 0.0, MAX_FLOAT32, hint=IN_FLOAT32)
                + check_range("optimizer.weight_decay", o.weight_decay, 0.0, MAX_FLOAT32, hint=IN_FLOAT32)
                + check_range("optimizer.max_grad_norm", o.max_grad_norm, 0.0, MAX_FLOAT32, open_low=True,
                              hint=", or null to disable clipping")
                + check_range("optimizer.momentum", o.momentum, 0.0, MAX_FLOAT32, hint=IN_FLOAT32)
                + check_range("optimizer.eps", o.eps, 0.0, MAX_FLOAT32, open_low=True, hint=IN_FLOAT32))
    if name == "sgd" and not o._target_ and o.nesterov and not (o.momentum or 0) > 0:
        problems.append("optimizer.nesterov: Nesterov momentum needs optimizer.momentum > 0; set it "
                        "(e.g. optimizer.momentum=0.9) or set nesterov to false")
    for field_name in sorted({f for fs in FIELDS_BY_OPTIMIZER.values() for f in fs} - set(FIELDS_BY_OPTIMIZER[name])):
        if getattr(o, field_name) is not None and not o._target_:  # a `_target_` class: target_rules
            owners = ", ".join(n for n, fs in FIELDS_BY_OPTIMIZER.items() if field_name in fs)
            problems.append(f"optimizer.{field_name}: only {owners} understands it (optimizer is {name}); "
                            "remove it or choose that optimizer")
    if o.betas is not None and len(o.betas) != 2:
        problems.append(f"optimizer.betas: {list(o.betas)} must be two numbers in [0, 1)")
    for i, beta in enumerate(o.betas or ()):
        problems += check_range(f"optimizer.betas[{i}]", beta, 0.0, 1.0, open_high=True)
    try:
        groups = param_group_configs(o.groups)
    except ValueError as e:
        problems.append(str(e))
        groups = {}
    for group_name, group in groups.items():
        problems += (check_range(f"optimizer.groups.{group_name}.lr_scale", group.lr_scale, 0.0, MAX_FLOAT32,
                                 hint=IN_FLOAT32)
                     + check_range(f"optimizer.groups.{group_name}.weight_decay", group.weight_decay, 0.0,
                                   MAX_FLOAT32, hint=IN_FLOAT32))
    return problems + rate_rules(cfg, groups) + schedule_rules(cfg) + plateau_rules(cfg)


def rate_rules(cfg: RunConfig, groups: dict) -> list[str]:
    """Each parameter group's rate (``lr * lr_scale``), and with adam/adamw the first step's step size (the
    rate over ``1 - betas[0]``), must be finite in float32: the settings alone can be, and their product
    not (``optimizer.groups.head.lr_scale=1e300``), which torch would refuse at the first step."""
    o = cfg.optimizer
    name = getattr(o.name, "value", o.name)
    beta1 = (o.betas or (0.9, 0.999))[0]
    adam = name in ("adam", "adamw") and not o._target_ and 0.0 <= beta1 < 1.0
    divisor = 1.0 - beta1 if adam else 1.0
    problems: list[str] = []
    if not 0.0 <= o.lr <= MAX_FLOAT32:  # out of range (NaN too): the range rule named it
        return problems
    for key, scale in [("optimizer.lr", 1.0)] + [(f"optimizer.groups.{n}.lr_scale", g.lr_scale)
                                                  for n, g in groups.items() if 0.0 <= g.lr_scale <= MAX_FLOAT32]:
        rate = o.lr * scale
        if rate > MAX_FLOAT32:
            problems.append(f"{key}: optimizer.lr ({o.lr:g}) times lr_scale ({scale:g}) is {rate:g}, more than "
                            f"float32's largest number ({MAX_FLOAT32:g}), in which the optimizer computes the "
                            "group's rate; lower one of them")
        elif rate / divisor > MAX_FLOAT32:
            problems.append(f"{key}: the rate {rate:g} over 1 - betas[0] ({divisor:g}), {name}'s first step size, "
                            f"is {rate / divisor:g}, more than float32's largest number ({MAX_FLOAT32:g}); lower it")
    return problems


def schedule_rules(cfg: RunConfig) -> list[str]:
    """``warmup_steps``, and the final rate: ``min_lr_ratio`` in [0, 1], or an absolute ``min_lr`` up to the
    rate; both set at once (other than the optimizer group file's ratio, which ``min_lr`` replaces) is
    refused."""
    o, s = cfg.optimizer, cfg.optimizer.schedule
    problems = (check_range("optimizer.schedule.warmup_steps", s.warmup_steps, 0, MAX_COUNT)
                + check_range("optimizer.schedule.warmup_epochs", s.warmup_epochs, 0.0, float(MAX_COUNT))
                + check_range("optimizer.schedule.min_lr_ratio", s.min_lr_ratio, 0.0, 1.0,
                              hint=" (a fraction of optimizer.lr)"))
    if s.warmup_epochs is not None and not s._target_ and o.is_set("schedule.warmup_steps"):
        problems.append(f"optimizer.schedule.warmup_steps, optimizer.schedule.warmup_epochs: both are set "
                        f"({s.warmup_steps} steps, {s.warmup_epochs} epochs); keep one")
    if s.min_lr is not None and o.is_set("schedule.min_lr_ratio"):
        problems.append(f"optimizer.schedule.min_lr, optimizer.schedule.min_lr_ratio: both set ({s.min_lr:g} and "
                        f"{s.min_lr_ratio:g}), and each alone says where the rate ends; keep one "
                        "(optimizer.schedule.min_lr=null, or optimizer.schedule.min_lr_ratio=0)")
    finite = math.isfinite(o.lr)
    hint = (" (optimizer.lr)" + (": the schedule decays the rate to it; set optimizer.schedule.min_lr_ratio=0.1 "
                                 "(a tenth of the rate, whatever it is) and min_lr=null" if o.lr > 0 else "")
            if finite else "")
    return problems + check_range("optimizer.schedule.min_lr", s.min_lr, 0.0, o.lr if finite else None, hint=hint)



def plateau_rules(cfg: RunConfig) -> list[str]:
    """``schedule.name=plateau``'s settings in range (whatever the schedule: every number is checked), and
    evaluations to step on."""
    s = cfg.optimizer.schedule
    problems = (check_range("optimizer.schedule.factor", s.factor, 0.0, 1.0, open_low=True, open_high=True)
                + check_range("optimizer.schedule.patience", s.patience, 0, MAX_COUNT)
                + check_range("optimizer.schedule.cooldown", s.cooldown, 0, MAX_COUNT)
                + check_range("optimizer.schedule.threshold", s.threshold, 0.0))
    if getattr(s.name, "value", s.name) == "plateau" and not s._target_ and not eval_sets(cfg.data):
        problems.append("optimizer.schedule.name=plateau: it steps on evaluations, and this run has none; set "
                        "data.val (and loop.eval_every), or choose another schedule")
    return problems


def target_rules(cfg: RunConfig) -> list[str]:
    """An optimizer or schedule by ``_target_``: importable and taking the arguments given (whether a
    backend can run the class is its own rule: CSX needs state it can preinitialise)."""
    problems = []
    for node, spec in ((cfg.optimizer, optimizer_spec), (cfg.optimizer.schedule, schedule_spec)):
        if not node._target_:
            continue
        try:
            spec(cfg.optimizer)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def loop_rules(cfg: RunConfig) -> list[str]:
    lp = cfg.loop
    problems = []
    if (lp.max_steps is None) == (lp.max_epochs is None):
        problems.append("loop.max_steps, loop.max_epochs: set exactly one of them "
                        "(e.g. loop.max_steps=100 loop.max_epochs=null)")
    for key in ("max_steps", "max_epochs", "eval_every", "eval_every_epochs", "eval_steps", "grad_accum_steps",
                "log_every"):
        problems += check_range(f"loop.{key}", getattr(lp, key), 1, MAX_COUNT)
    if lp.eval_every is not None and lp.eval_every_epochs is not None:
        problems.append(f"loop.eval_every, loop.eval_every_epochs: both are set ({lp.eval_every} steps, "
                        f"{lp.eval_every_epochs} epochs); evaluate by steps or by epochs: set the other to null "
                        "(e.g. loop.eval_every=null)")
    problems += check_range("loop.collect_max_memory_mb", lp.collect_max_memory_mb, 0.0, MAX_MEMORY_MB,
                            open_low=True)
    if lp.collect and not eval_sets(cfg.data):
        problems.append("loop.collect: it collects evaluation outputs, and this run has no data.val; "
                        "set data.val or remove loop.collect")
    if lp.collect_save and not lp.collect:
        problems.append("loop.collect_save: there is nothing to save; name the outputs in loop.collect")
    if len(set(lp.collect)) != len(lp.collect):
        problems.append(f"loop.collect: {list(lp.collect)} names a key twice; name each once")
    return problems


def data_rules(cfg: RunConfig) -> list[str]:
    d = cfg.data
    problems = []
    if not isinstance(d.train, dict) or "_target_" not in d.train:
        problems.append("data.train: needs a _target_ that builds a torch Dataset")
    if d.val is not None and (not isinstance(d.val, dict) or "_target_" not in d.val):
        problems.append("data.val: needs a _target_ that builds a torch Dataset, or null")
    problems += eval_set_rules(d) + test_set_rules(d)
    problems += (check_range("data.batch_size", d.batch_size, 1, MAX_COUNT)
                 + check_range("data.eval_batch_size", d.eval_batch_size, 1, MAX_COUNT)
                 + check_range("data.num_workers", d.num_workers, 0, MAX_PARALLEL)
                 + check_range("data.prefetch_factor", d.prefetch_factor, 1, MAX_COUNT)
                 + check_range("data.timeout_s", d.timeout_s, 0, MAX_TIMEOUT_S,
                               hint=" seconds (0 waits forever)"))
    for key in ("persistent_workers", "prefetch_factor"):
        if getattr(d, key) not in (None, False) and d.num_workers <= 0:
            problems.append(f"data.{key}: needs loader workers; set data.num_workers > 0, or remove it")
    if d.collate_fn is not None and not isinstance(d.collate_fn, str) and (
            not isinstance(d.collate_fn, dict) or "_target_" not in d.collate_fn):
        problems.append("data.collate_fn: needs a _target_ naming a function or class, or null")
    if not isinstance(cfg.model, dict) or "_target_" not in cfg.model:
        problems.append("model: needs a _target_ that builds a torch.nn.Module")
    return problems


def eval_set_rules(d) -> list[str]:
    """``data.eval``: named datasets whose names make metric prefixes of their own."""
    problems = []
    if d.val is not None and d.eval.get("val") is not None:
        problems.append("data.eval.val: data.val is set too, and it is the short form of data.eval.val; keep one")
    for name, spec in d.eval.items():
        if name == "train" or "/" in name or not name:
            problems.append(f"data.eval.{name}: the metrics of a set are <name>/loss ...; "
                            + ("train/* are the training metrics" if name == "train" else "a name needs no '/'")
                            + "; name it otherwise (e.g. data.eval.train_sample)")
        elif spec is not None and (not isinstance(spec, dict) or "_target_" not in spec):
            problems.append(f"data.eval.{name}: needs a _target_ that builds a torch Dataset, or null")
    return problems


def test_set_rules(d) -> list[str]:
    """``data.test``, ``data.test_sets``, ``data.predict``: datasets; a test set's name is its metrics'
    prefix, which no evaluation set or training may have."""
    problems = []
    if d.test is not None and d.test_sets.get("test") is not None:
        problems.append("data.test_sets.test: data.test is set too, and it is the short form of "
                        "data.test_sets.test; keep one")
    taken = {"train", *eval_sets(d)}
    for name, spec in test_sets(d).items():
        key = test_set_key(d, name)
        if name in taken or "/" in name or not name:
            problems.append(f"{key}: the metrics of a set are <name>/loss ..., and "
                            + (f"'{name}' is taken (by training or an evaluation set)" if name in taken
                               else "a name needs no '/'") + f"; name it otherwise (e.g. data.test_sets.{name}_test)")
        elif not isinstance(spec, dict) or "_target_" not in spec:
            problems.append(f"{key}: needs a _target_ that builds a torch Dataset, or null")
    if d.predict is not None and (not isinstance(d.predict, dict) or "_target_" not in d.predict):
        problems.append("data.predict: needs a _target_ that builds a torch Dataset, or null")
    return problems


def checkpoint_rules(cfg: RunConfig) -> list[str]:
    c = cfg.checkpoint
    problems = (check_range("checkpoint.every_steps", c.every_steps, 1, MAX_COUNT, hint=" (or null)")
                + check_range("checkpoint.every_epochs", c.every_epochs, 1, MAX_COUNT, hint=" (or null)")
                + check_range("checkpoint.keep_last", c.keep_last, 1, MAX_COUNT))
    if c.every_steps is not None and c.every_epochs is not None:
        problems.append(f"checkpoint.every_steps, checkpoint.every_epochs: both are set ({c.every_steps} steps, "
                        f"{c.every_epochs} epochs); save by steps or by epochs: set the other to null")
    monitor = c.keep_best.monitor
    if monitor and monitor.startswith("val/") and "val" not in eval_sets(cfg.data):
        problems.append(f"checkpoint.keep_best.monitor: {monitor} comes from evaluation, but data.val is null; "
                        "set data.val, or monitor a train/ metric")
    if c.resume not in ("auto", "never") and not os.path.exists(c.resume):
        problems.append(f"checkpoint.resume: no checkpoint at '{c.resume}'; give an existing checkpoint "
                        "directory, or auto / never")
    return problems


def across_stages(config: RunConfig, stages: list[tuple[str, RunConfig]]) -> list[str]:
    """DESIGN 4.3: one device type per run (a backend's own global settings are its plugin's rule)."""
    return [f"{prefix}device: {cfg.device.type} differs from the run's device {config.device.type}; all stages "
            "of a run use one device type" for prefix, cfg in stages if cfg.device.type != config.device.type]

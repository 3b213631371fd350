"""The validation plugin: rejects bad runs before anything is built (DESIGN section 4).

Every rule returns problem lines that name the key and say how to fix it; all are reported together.
Every number is range-checked with ``check_range`` (NaN and infinities included) before anything is built.
"""
from __future__ import annotations

import math
import os

import torch

from ..config import FIELDS_BY_OPTIMIZER, FIELDS_BY_TYPE, PRECISIONS, RunConfig, stage_config
from ..config.backend import DEVICE_TYPES
from ..errors import ConfigError
from ..plugins import hookimpl


#: Steps, epochs, batch sizes and other counts: exact as float64 (metrics, JSON) and far from int64 overflow.
MAX_COUNT = 2**53
#: Threads and loader worker processes: a sane ceiling (more would exhaust processes or memory).
MAX_PARALLEL = 1024
#: Longest wait a timeout may ask for: one year (a larger one overflows the waits underneath).
MAX_TIMEOUT_S = 365 * 86400
#: Seeds: the range of NumPy's seed; ``seed * 1_000_003 + epoch`` (data order) then stays below 2**64,
#: the limit of ``torch.Generator.manual_seed``.
MAX_SEED = 2**32 - 1
#: Loss scales live in float32 tensors.
MAX_SCALE = float(torch.finfo(torch.float32).max)
#: The dynamic loss scaler counts towards ``growth_interval`` in an int32 tensor.
MAX_GROWTH_INTERVAL = 2**31 - 1


def check_range(key: str, value, low=None, high=None, *, open_low: bool = False, open_high: bool = False,
                hint: str = "") -> list[str]:
    """``[]`` when ``value`` is ``None`` (not set) or a finite number within the bounds (``open_*``: the
    bound itself excluded), else the problem line naming ``key``. Finiteness is tested first: every
    comparison with NaN is false, so a bare ``value < low`` would let NaN through."""
    if value is None:
        return []
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if finite and not (low is not None and (value <= low if open_low else value < low)
                       or high is not None and (value >= high if open_high else value > high)):
        return []
    shown = [f"{b:g}" if isinstance(b, float) else str(b) for b in (low, high)]
    if low is not None and high is not None:
        bounds = (f"between {shown[0]} and {shown[1]}" if not (open_low or open_high) else
                  f"in {'(' if open_low else '['}{shown[0]}, {shown[1]}{')' if open_high else ']'}")
    elif low is not None:
        bounds = f"{'>' if open_low else '>='} {shown[0]}"
    else:
        bounds = f"{'<' if open_high else '<='} {shown[1]}"
    return [f"{key}: {value} must be {'' if finite else 'a finite number '}{bounds}{hint}"]


@hookimpl
def csframework_validate(config: RunConfig) -> list[str]:
    problems = device_choice(config)
    stages = [("", config)]
    for name, partial in config.stages.items():
        try:
            stages.append((f"stages.{name}.", stage_config(config, name, partial)))
        except ConfigError as e:
            problems.append(str(e))
    base = run_rules(config, skip_device_pair=bool(problems))
    problems += base
    for prefix, cfg in stages[1:]:  # a stage inherits the base's problems: name only its own
        if cfg.device.type == config.device.type:
            problems += [prefix + p for p in run_rules(cfg) if p not in base]
    problems += across_stages(config, stages[1:])
    return problems


def device_choice(cfg: RunConfig) -> list[str]:
    """DESIGN 4.2: ``device`` and ``backend`` are mutually exclusive ways to choose the device."""
    if {"device", "backend"} <= set(cfg.selected):
        return [f"device, backend: both choose the device (device={cfg.device.type.lower()}, "
                f"backend={cfg.backend.type.lower()}); they are mutually exclusive: choose it with "
                "device=<type> and tune it with backend.<field>=<value>, or use backend=<type> alone"]
    return []


def run_rules(cfg: RunConfig, skip_device_pair: bool = False) -> list[str]:
    """The rules of one (stage) config. Backend settings are only judged when the backend's type is the
    device's; otherwise the disagreement is the one problem to report."""
    problems = device_rules(cfg, skip_device_pair)
    if cfg.backend.type == cfg.device.type:
        problems += backend_rules(cfg)
    return (problems + precision_rules(cfg) + optimizer_rules(cfg) + loop_rules(cfg) + data_rules(cfg)
            + checkpoint_rules(cfg) + check_range("seed", cfg.seed, 0, MAX_SEED,
                                                  hint=" (the range of every generator seeded from it)"))


def device_rules(cfg: RunConfig, skip_device_pair: bool = False) -> list[str]:
    kind, backend = cfg.device.type, cfg.backend.type
    problems = []
    if kind not in DEVICE_TYPES:
        problems.append(f"device.type: '{kind}' is not a device type; use device=cpu, device=gpu or device=csx")
    if backend not in DEVICE_TYPES:
        problems.append(f"backend.type: '{backend}' is not a device type; use CPU, GPU or CSX")
    elif backend != kind and kind in DEVICE_TYPES and not skip_device_pair:
        problems.append(f"device, backend.type: the backend is {backend} but the device is {kind}; "
                        f"set only one of them (device={kind.lower()} picks its own backend)")
    if kind == "GPU" and not torch.cuda.is_available():
        problems.append("device: gpu needs CUDA, which is not available on this machine; use device=cpu "
                        "(or device=csx to emulate a Cerebras system)")
    return problems


def backend_rules(cfg: RunConfig) -> list[str]:
    """DESIGN 4.4 and 4.5: settings of another device type are errors, never ignored."""
    kind, b = cfg.device.type, cfg.backend
    if kind not in FIELDS_BY_TYPE:
        return []
    problems = []
    own = FIELDS_BY_TYPE[kind]
    for field_name in sorted({f for fields in FIELDS_BY_TYPE.values() for f in fields} - set(own)):
        if getattr(b, field_name) is not None:
            owners = "/".join(t for t, fields in FIELDS_BY_TYPE.items() if field_name in fields)
            problems.append(f"backend.{field_name}: only {owners} understands it, and this run's device is "
                            f"{kind}; remove it or use device={owners.split('/')[0].lower()}")
    if kind == "CSX":
        problems += check_range("backend.num_csx", b.num_csx, 1, cfg.data.batch_size,
                                hint=" (data.batch_size): each system needs at least one sample")
        problems += check_range("backend.num_workers_per_csx", b.num_workers_per_csx, 0, MAX_PARALLEL,
                                hint=" (0: the default)")
        if b.compile_only and b.validate_only:
            problems.append("backend.compile_only, backend.validate_only: choose one of them")
        return problems
    problems += check_range("backend.threads", b.threads, 0, MAX_PARALLEL, hint=" (0 keeps torch's default)")
    if kind == "GPU":
        count = torch.cuda.device_count()
        problems += check_range("backend.device_index", b.device_index, 0, (count or MAX_PARALLEL) - 1,
                                hint=f" (this machine has {count} CUDA devices)" if count else "")
    return problems


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
    if p.name == "cbfloat16":
        if cfg.device.type != "CSX":
            problems.append(f"precision: cbfloat16 needs device=csx (this run's device is {cfg.device.type}); "
                            "use precision=bfloat16 or float16 on CPU/GPU")
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


def optimizer_rules(cfg: RunConfig) -> list[str]:
    o = cfg.optimizer
    name = getattr(o.name, "value", o.name)
    problems = (check_range("optimizer.lr", o.lr, 0.0) + check_range("optimizer.weight_decay", o.weight_decay, 0.0)
                + check_range("optimizer.max_grad_norm", o.max_grad_norm, 0.0, open_low=True,
                              hint=", or null to disable clipping")
                + check_range("optimizer.momentum", o.momentum, 0.0)
                + check_range("optimizer.eps", o.eps, 0.0, open_low=True))
    if name == "sgd" and o.nesterov and not (o.momentum or 0) > 0:
        problems.append("optimizer.nesterov: Nesterov momentum needs optimizer.momentum > 0; set it "
                        "(e.g. optimizer.momentum=0.9) or set nesterov to false")
    for field_name in sorted({f for fs in FIELDS_BY_OPTIMIZER.values() for f in fs} - set(FIELDS_BY_OPTIMIZER[name])):
        if getattr(o, field_name) is not None:
            owners = ", ".join(n for n, fs in FIELDS_BY_OPTIMIZER.items() if field_name in fs)
            problems.append(f"optimizer.{field_name}: only {owners} understands it (optimizer is {name}); "
                            "remove it or choose that optimizer")
    if o.betas is not None and len(o.betas) != 2:
        problems.append(f"optimizer.betas: {list(o.betas)} must be two numbers in [0, 1)")
    for i, beta in enumerate(o.betas or ()):
        problems += check_range(f"optimizer.betas[{i}]", beta, 0.0, 1.0, open_high=True)
    s = o.schedule
    return (problems + check_range("optimizer.schedule.warmup_steps", s.warmup_steps, 0, MAX_COUNT)
            + check_range("optimizer.schedule.min_lr", s.min_lr, 0.0, o.lr if math.isfinite(o.lr) else None,
                          hint=" (optimizer.lr)" if math.isfinite(o.lr) else ""))


def loop_rules(cfg: RunConfig) -> list[str]:
    lp = cfg.loop
    problems = []
    if (lp.max_steps is None) == (lp.max_epochs is None):
        problems.append("loop.max_steps, loop.max_epochs: set exactly one of them "
                        "(e.g. loop.max_steps=100 loop.max_epochs=null)")
    for key in ("max_steps", "max_epochs", "eval_every", "eval_steps", "grad_accum_steps", "log_every"):
        problems += check_range(f"loop.{key}", getattr(lp, key), 1, MAX_COUNT)
    return problems


def data_rules(cfg: RunConfig) -> list[str]:
    d = cfg.data
    problems = []
    if not isinstance(d.train, dict) or "_target_" not in d.train:
        problems.append("data.train: needs a _target_ that builds a torch Dataset")
    if d.val is not None and (not isinstance(d.val, dict) or "_target_" not in d.val):
        problems.append("data.val: needs a _target_ that builds a torch Dataset, or null")
    problems += (check_range("data.batch_size", d.batch_size, 1, MAX_COUNT)
                 + check_range("data.eval_batch_size", d.eval_batch_size, 1, MAX_COUNT)
                 + check_range("data.num_workers", d.num_workers, 0, MAX_PARALLEL)
                 + check_range("data.timeout_s", d.timeout_s, 0, MAX_TIMEOUT_S,
                               hint=" seconds (0 waits forever)"))
    if not isinstance(cfg.model, dict) or "_target_" not in cfg.model:
        problems.append("model: needs a _target_ that builds a torch.nn.Module")
    return problems


def checkpoint_rules(cfg: RunConfig) -> list[str]:
    c = cfg.checkpoint
    problems = (check_range("checkpoint.every_steps", c.every_steps, 1, MAX_COUNT, hint=" (or null)")
                + check_range("checkpoint.keep_last", c.keep_last, 1, MAX_COUNT))
    if c.resume not in ("auto", "never") and not os.path.exists(c.resume):
        problems.append(f"checkpoint.resume: no checkpoint at '{c.resume}'; give an existing checkpoint "
                        "directory, or auto / never")
    return problems


def across_stages(config: RunConfig, stages: list[tuple[str, RunConfig]]) -> list[str]:
    """DESIGN 4.3 and 4.5: one device type per run; CSX global settings equal in every stage."""
    problems = []
    for prefix, cfg in stages:
        if cfg.device.type != config.device.type:
            problems.append(f"{prefix}device: {cfg.device.type} differs from the run's device "
                            f"{config.device.type}; all stages of a run use one device type")
        for key in ("num_csx", "num_workers_per_csx"):
            if getattr(cfg.backend, key) != getattr(config.backend, key):
                problems.append(f"{prefix}backend.{key}: {getattr(cfg.backend, key)} differs from the run's "
                                f"{getattr(config.backend, key)}; it is global across the stages of a run")
    return problems

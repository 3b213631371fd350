"""``csframework.config.ranges`` and the schemas' numeric fields.

Hostile numbers in the config: every numeric setting is range-checked (NaN and infinities included)
before anything is built, and the problem names the key; torch never gets to raise its own error.

In-process cases merge the values into a config Hydra composed once per group choice (fast); the CLI cases
run ``python -m csframework``'s ``main()`` in forked processes (exit status 2, one line, no traceback).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import typing
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import csframework as csf
from csframework.builtin import validation
from csframework.backends.csx.schema import CsxConfig
from csframework.backends.eager import CpuConfig, GpuConfig
from csframework.api import to_run_config
from csframework.backends.csx.plugin import CsxPlugin
from csframework.backends.eager import EagerPlugin
from csframework.config import FIELDS_BY_OPTIMIZER, RunConfig
from csframework.config.optimizer import mark_user_set
from csframework.errors import ConfigError, ValidationError
import fixtures
from fixtures import CONF, TINY
from forkrun import run_chains

NAN, INF = float("nan"), float("inf")


@functools.lru_cache(maxsize=None)
def composed(*groups: str) -> RunConfig:
    """The tiny run with these group choices (e.g. ``optimizer=adam``), composed by Hydra once."""
    chosen = {g.split("=")[0] for g in groups}
    return csf.compose([o for o in TINY if o.split("=")[0] not in chosen] + list(groups), config_dir=CONF)


def config(groups: tuple[str, ...], values: dict) -> RunConfig:
    """``composed(*groups)`` with ``values`` (dotted key -> value) set as a command line would set them."""
    run_config = composed(*groups)
    base = OmegaConf.structured(run_config)
    for key, value in values.items():
        OmegaConf.update(base, key, value, force_add=key.startswith("stages."))
    cfg = to_run_config(base, run_config.selected)  # not a config key: set on the instance
    # the values count as the user's, as the overrides that name them do (OptimizerConfig.is_set)
    mark_user_set(cfg.optimizer, True, cfg.optimizer.overridden | set(values))  # composed from our group files
    return cfg


def problems(groups: tuple[str, ...], values: dict) -> list[str]:
    """What the built-in validation rules find: the core's and the backend plugins'."""
    cfg = config(groups, values)
    return (validation.csframework_validate(config=cfg) + EagerPlugin().csframework_validate(config=cfg)
            + CsxPlugin().csframework_validate(config=cfg))


ADAM, CSX, GPU, FP16 = ("optimizer=adam",), ("device=csx",), ("device=gpu",), ("precision=float16",)

# (groups, values, the key the problem must start with)
CASES = {
    "lr-nan": ((), {"optimizer.lr": NAN}, "optimizer.lr"),
    "lr-inf": ((), {"optimizer.lr": INF}, "optimizer.lr"),
    "lr-minus-inf": ((), {"optimizer.lr": -INF}, "optimizer.lr"),
    "lr-negative": ((), {"optimizer.lr": -0.1}, "optimizer.lr"),
    "weight-decay-nan": ((), {"optimizer.weight_decay": NAN}, "optimizer.weight_decay"),
    "weight-decay-negative": ((), {"optimizer.weight_decay": -1e-4}, "optimizer.weight_decay"),
    "momentum-negative": ((), {"optimizer.momentum": -1.0}, "optimizer.momentum"),
    "momentum-nan": ((), {"optimizer.momentum": NAN}, "optimizer.momentum"),
    "nesterov-without-momentum": ((), {"optimizer.nesterov": True, "optimizer.momentum": 0.0}, "optimizer.nesterov"),
    "nesterov-momentum-null": ((), {"optimizer.nesterov": True, "optimizer.momentum": None}, "optimizer.nesterov"),
    "beta-one": (ADAM, {"optimizer.betas": [0.9, 1.0]}, "optimizer.betas[1]"),
    "beta-nan": (ADAM, {"optimizer.betas": [NAN, 0.999]}, "optimizer.betas[0]"),
    "beta-negative": (ADAM, {"optimizer.betas": [-0.1, 0.999]}, "optimizer.betas[0]"),
    "three-betas": (ADAM, {"optimizer.betas": [0.9, 0.99, 0.999]}, "optimizer.betas"),
    "eps-zero": (ADAM, {"optimizer.eps": 0.0}, "optimizer.eps"),
    "eps-negative": (ADAM, {"optimizer.eps": -1e-8}, "optimizer.eps"),
    "eps-nan": (ADAM, {"optimizer.eps": NAN}, "optimizer.eps"),
    "clip-zero": ((), {"optimizer.max_grad_norm": 0.0}, "optimizer.max_grad_norm"),
    "clip-inf": ((), {"optimizer.max_grad_norm": INF}, "optimizer.max_grad_norm"),
    "clip-nan": ((), {"optimizer.max_grad_norm": NAN}, "optimizer.max_grad_norm"),
    "warmup-negative": ((), {"optimizer.schedule.warmup_steps": -1}, "optimizer.schedule.warmup_steps"),
    "min-lr-nan": ((), {"optimizer.schedule.min_lr": NAN}, "optimizer.schedule.min_lr"),
    "min-lr-negative": ((), {"optimizer.schedule.min_lr": -1e-3}, "optimizer.schedule.min_lr"),
    "min-lr-above-lr": ((), {"optimizer.schedule.min_lr": 1.0}, "optimizer.schedule.min_lr"),
    "init-scale-nan": (FP16, {"precision.init_scale": NAN}, "precision.init_scale"),
    "init-scale-zero": (FP16, {"precision.init_scale": 0.0}, "precision.init_scale"),
    "init-scale-beyond-float32": (FP16, {"precision.init_scale": 1e39}, "precision.init_scale"),
    "min-scale-inf": (FP16, {"precision.min_scale": INF}, "precision.min_scale"),
    "min-scale-above-init": (FP16, {"precision.min_scale": 1e6, "precision.init_scale": 8.0}, "precision.min_scale"),
    "growth-interval-zero": (FP16, {"precision.growth_interval": 0}, "precision.growth_interval"),
    "growth-interval-beyond-int32": (FP16, {"precision.growth_interval": 2**31}, "precision.growth_interval"),
    "fixed-scale-nan": (FP16, {"precision.loss_scaling": NAN}, "precision.loss_scaling"),
    "fixed-scale-inf": (FP16, {"precision.loss_scaling": INF}, "precision.loss_scaling"),
    "fixed-scale-negative": (FP16, {"precision.loss_scaling": -128.0}, "precision.loss_scaling"),
    "seed-negative": ((), {"seed": -1}, "seed"),
    "seed-2**32": ((), {"seed": 2**32}, "seed"),
    "seed-huge": ((), {"seed": 99999999999999999999}, "seed"),
    "threads-negative": ((), {"backend.threads": -1}, "backend.threads"),
    "threads-huge": ((), {"backend.threads": 100000}, "backend.threads"),
    "device-index-negative": (GPU, {"backend.device_index": -1}, "backend.device_index"),
    "device-index-huge": (GPU, {"backend.device_index": 10**6}, "backend.device_index"),
    "num-csx-zero": (CSX, {"backend.num_csx": 0}, "backend.num_csx"),
    "num-csx-above-batch": (CSX, {"backend.num_csx": 10**6}, "backend.num_csx"),
    "csx-workers-negative": (CSX, {"backend.num_workers_per_csx": -1}, "backend.num_workers_per_csx"),
    "csx-workers-huge": (CSX, {"backend.num_workers_per_csx": 10**5}, "backend.num_workers_per_csx"),
    "workers-negative": ((), {"data.num_workers": -1}, "data.num_workers"),
    "workers-huge": ((), {"data.num_workers": 100000}, "data.num_workers"),
    "batch-zero": ((), {"data.batch_size": 0}, "data.batch_size"),
    "batch-beyond-int64": ((), {"data.batch_size": 2**70}, "data.batch_size"),
    "eval-batch-zero": ((), {"data.eval_batch_size": 0}, "data.eval_batch_size"),
    "keep-last-zero": ((), {"checkpoint.keep_last": 0}, "checkpoint.keep_last"),
    "keep-last-huge": ((), {"checkpoint.keep_last": 2**70}, "checkpoint.keep_last"),
    "every-steps-zero": ((), {"checkpoint.every_steps": 0}, "checkpoint.every_steps"),
    "max-steps-huge": ((), {"loop.max_steps": 10**20}, "loop.max_steps"),
    "max-epochs-zero": ((), {"loop.max_steps": None, "loop.max_epochs": 0}, "loop.max_epochs"),
    "accumulation-zero": ((), {"loop.grad_accum_steps": 0}, "loop.grad_accum_steps"),
    "log-every-zero": ((), {"loop.log_every": 0}, "loop.log_every"),
    "stage-lr-nan": ((), {"stages.warm.optimizer.lr": NAN}, "stages.warm.optimizer.lr"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_number_is_refused_before_anything_is_built_naming_the_key(case, tmp_path):
    groups, values, key = CASES[case]
    with pytest.raises(ValidationError) as caught:
        csf.Run(config(groups, values), output_dir=tmp_path)
    named = [p for p in caught.value.problems if p.startswith(f"{key}:")]
    assert named, caught.value.problems
    assert not list(tmp_path.iterdir())  # nothing written


def _numeric_fields(cls, prefix: str = ""):
    """(dotted key, type) of every int and float field of the schema, nested sections included."""
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(kind):
            yield from _numeric_fields(kind, f"{prefix}{f.name}.")
        elif kind in (int, float):
            yield f"{prefix}{f.name}", kind


#: The backend schemas of the built-in backend plugins, and the fields each device type understands.
BACKENDS = {"CPU": CpuConfig, "GPU": GpuConfig, "CSX": CsxConfig}
FIELDS_BY_TYPE = {t: tuple(f.name for f in dataclasses.fields(s) if f.name != "type") for t, s in BACKENDS.items()}
NUMERIC_FIELDS = dict(_numeric_fields(RunConfig))
for _schema in BACKENDS.values():  # ``backend`` is typed by its device type's schema
    NUMERIC_FIELDS.update(_numeric_fields(_schema, "backend."))


def _groups_for(key: str) -> tuple[str, ...]:
    """Group choices under which ``key`` is understood (a backend or optimizer field of one type only)."""
    section, _, name = key.partition(".")
    if section == "backend":
        kind = next(t for t, fields in FIELDS_BY_TYPE.items() if name in fields)
        return () if kind == "CPU" else (f"device={kind.lower()}",)
    if section == "optimizer" and not any(name in fields for fields in FIELDS_BY_OPTIMIZER.values()):
        return ()
    if section == "optimizer":
        return () if name in FIELDS_BY_OPTIMIZER["sgd"] else ADAM
    return FP16 if section == "precision" else ()


def test_the_schema_has_the_numbers_this_file_expects():
    assert {"optimizer.lr", "optimizer.eps", "seed", "backend.threads", "data.num_workers",
            "precision.growth_interval", "loop.max_steps"} <= set(NUMERIC_FIELDS)


@pytest.mark.parametrize("float_value, int_value", [(NAN, 10**30), (INF, -10**30), (-INF, 10**30)])
def test_every_number_in_the_schema_has_a_range(float_value, int_value):
    """A new numeric setting without a range check fails here. All the settings understood under one group
    choice are set at once (every problem is reported together)."""
    by_groups: dict[tuple, dict] = {}
    for key, kind in NUMERIC_FIELDS.items():
        by_groups.setdefault(_groups_for(key), {})[key] = float_value if kind is float else int_value
    unnamed = []
    for groups, values in by_groups.items():
        found = problems(groups, values)
        unnamed += [key for key, value in values.items() if not any(p.startswith(f"{key}: {value} must be")
                                                                     for p in found)]
    assert not unnamed, unnamed


@pytest.mark.parametrize("groups, values", [
    ((), {"seed": 0}), ((), {"seed": 2**32 - 1}), ((), {"optimizer.lr": 0.0, "optimizer.schedule.min_lr": 0.0}),
    ((), {"optimizer.momentum": 0.0, "backend.threads": 0, "data.num_workers": 0}),
    ((), {"optimizer.nesterov": True, "optimizer.momentum": 0.9}),
    (ADAM, {"optimizer.betas": [0.0, 0.999], "optimizer.eps": 1e-12}),
    (FP16, {"precision.init_scale": 1.0, "precision.min_scale": 1.0, "precision.growth_interval": 2**31 - 1}),
    (CSX, {"backend.num_csx": 16, "backend.num_workers_per_csx": 0}),
], ids=["seed-0", "seed-max", "lr-0", "zeros", "nesterov", "betas", "scales", "csx"])
def test_the_edges_of_each_range_are_accepted(groups, values):
    assert problems(groups, values) == []


@pytest.mark.parametrize("lr", [1e-4, 1e-7, 0.0])
def test_any_rate_is_accepted_by_the_presets_relative_floor(lr):
    """Issue 49 item 10: adamw's preset decays to a tenth of the rate (``min_lr_ratio: 0.1``), not to an
    absolute 3e-4 that refused every ``optimizer.lr`` below it."""
    from csframework.config.optimizer import final_lr

    cfg = config(("optimizer=adamw",), {"optimizer.lr": lr})
    assert problems(("optimizer=adamw",), {"optimizer.lr": lr}) == []
    assert final_lr(cfg.optimizer) == pytest.approx(lr / 10)


def test_an_absolute_floor_replaces_the_presets_ratio_and_both_set_are_refused():
    from csframework.config.optimizer import final_lr

    assert final_lr(config(("optimizer=adamw",), {"optimizer.schedule.min_lr": 1e-5}).optimizer) == 1e-5
    assert problems(("optimizer=adamw",), {"optimizer.schedule.min_lr": 1e-5,
                                           "optimizer.schedule.min_lr_ratio": 0.2}) == [
        "optimizer.schedule.min_lr, optimizer.schedule.min_lr_ratio: both set (1e-05 and 0.2), and each alone says "
        "where the rate ends; keep one (optimizer.schedule.min_lr=null, or optimizer.schedule.min_lr_ratio=0)"]
    # an absolute floor above the rate still names the ratio that follows the rate
    assert problems(("optimizer=adamw",), {"optimizer.lr": 1e-4, "optimizer.schedule.min_lr": 3e-4}) == [
        "optimizer.schedule.min_lr: 0.0003 must be between 0 and 0.0001 (optimizer.lr): the schedule decays the "
        "rate to it; set optimizer.schedule.min_lr_ratio=0.1 (a tenth of the rate, whatever it is) and min_lr=null"]


FLOAT32_MAX = 3.4028234663852886e38


@pytest.mark.parametrize("groups, values, expected", [
    ((), {"optimizer.lr": 1e300}, "optimizer.lr: 1e+300 must be between 0 and 3.40282e+38 (float32's largest"),
    ((), {"optimizer.weight_decay": 1e39}, "optimizer.weight_decay: 1e+39 must be between 0 and 3.40282e+38"),
    (ADAM, {"optimizer.eps": 1e300}, "optimizer.eps: 1e+300 must be in (0, 3.40282e+38]"),
    ((), {"+optimizer.groups.h": {"params": ["*"], "lr_scale": 1e300}},
     "optimizer.groups.h.lr_scale: 1e+300 must be between 0 and 3.40282e+38"),
    ((), {"+optimizer.groups.h": {"params": ["*"], "weight_decay": 1e300}},
     "optimizer.groups.h.weight_decay: 1e+300 must be between 0 and 3.40282e+38"),
    ((), {"optimizer.lr": 1e20, "+optimizer.groups.h": {"params": ["*"], "lr_scale": 1e20}},
     "optimizer.groups.h.lr_scale: optimizer.lr (1e+20) times lr_scale (1e+20) is 1e+40, more than float32's "
     "largest number (3.40282e+38), in which the optimizer computes the group's rate; lower one of them"),
    (("optimizer=adamw",), {"optimizer.lr": 1e38},
     "optimizer.lr: the rate 1e+38 over 1 - betas[0] (0.1), adamw's first step size, is 1e+39, more than "
     "float32's largest number (3.40282e+38); lower it"),
], ids=["lr", "weight-decay", "eps", "lr-scale", "group-weight-decay", "lr-times-scale", "adam-step"])
def test_a_setting_or_rate_beyond_float32_is_refused_naming_the_key(groups, values, expected):
    """Issue 47 item 10: torch computes the update in float32, so a rate it cannot hold passed mode=check
    and failed the first step ("value cannot be converted to type float without overflow")."""
    values = {key.lstrip("+"): value for key, value in values.items()}
    found = problems(groups, values)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_largest_float32_rate_is_accepted():
    assert problems(("optimizer=sgd",), {"optimizer.lr": FLOAT32_MAX}) == []


def test_seed_range_keeps_the_derived_data_order_seeds_in_range():
    """The largest seed, at a late epoch, still seeds ``torch.Generator`` (data order) and NumPy."""
    from csframework.data import ResumableSampler
    from csframework.run import seed_everything

    sampler = ResumableSampler(8, shuffle=True, seed=validation.MAX_SEED)
    sampler.set_epoch(validation.MAX_COUNT)
    assert sorted(sampler) == list(range(8))
    seed_everything(validation.MAX_SEED)


@pytest.mark.parametrize("seed", [20240101, validation.MAX_SEED])
def test_every_allowed_seed_draws_a_sampled_evaluation(seed):
    """Issue 47 item 8: the draw of a sampled evaluation (``loop.eval_steps``) is seeded from ``seed`` and the
    draw; a seed above about 1.8e7 once took that seed past 2**64 (``manual_seed`` overflowed)."""
    from csframework.data import ResumableSampler

    for draw in (0, validation.MAX_COUNT):
        sampler = ResumableSampler(1000, shuffle=False, seed=seed, pad=True, sample=40)
        sampler.set_epoch(draw)
        drawn = sampler.order().tolist()
        assert len(set(drawn)) == 40 and drawn == sorted(drawn)


def test_a_small_seed_draws_the_samples_it_always_drew():
    from csframework.data import ResumableSampler

    sampler = ResumableSampler(1000, shuffle=False, seed=3, pad=True, sample=40)
    sampler.set_epoch(5)
    before = torch.randperm(1000, generator=torch.Generator().manual_seed((3 * 1_000_003 + 5) * 1_000_003 + 11))
    assert sampler.order().tolist() == before[:40].sort().values.tolist()


def test_torch_optimizer_errors_are_config_errors_when_validation_is_disabled(tmp_path):
    cfg = config((), {"optimizer.momentum": -1.0, "plugins.disable": ["validation"]})
    with pytest.raises(ConfigError, match=r"^optimizer: .*momentum"):
        csf.Run(cfg, output_dir=tmp_path)


# -- through the CLI ------------------------------------------------------------------------------------
BASE = ["--config-dir", CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=2", "loop.eval_every=null",
        "loop.eval_steps=null"]
CLI_CASES = [
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["optimizer.lr=-inf"], "optimizer.lr"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum"),
    (["optimizer=adam", "optimizer.eps=0"], "optimizer.eps"),
    (["seed=-1"], "seed"),
    (["seed=99999999999999999999"], "seed"),
    (["backend.threads=100000"], "backend.threads"),
    (["data.batch_size=1000000000"], "data.batch_size"),
    (["data.num_workers=100000"], "data.num_workers"),
]


@pytest.mark.slow
def test_cli_exits_2_naming_the_key_without_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath())
    env.pop("HYDRA_FULL_ERROR", None)
    chains = [[{"argv": BASE + extra + [f"hydra.run.dir={tmp_path / str(i)}"]}] for i, (extra, _) in enumerate(CLI_CASES)]
    for i, ((extra, key), [result]) in enumerate(zip(CLI_CASES, run_chains(chains, env))):
        stderr = result["stderr"]
        assert result["returncode"] == 2, (extra, stderr)
        assert "Traceback" not in stderr, (extra, stderr)
        assert f"csframework: error: invalid run: {key}: " in stderr or f"csframework: error: {key}: " in stderr, \
            (extra, stderr)
        assert not (tmp_path / str(i) / "checkpoints").exists()

"""Parameter groups from config (issue 40 item 1): ``optimizer.weight_decay_exclude`` (default: parameters
with fewer than two dimensions), ``optimizer.groups`` (name patterns -> lr scale, weight decay), for the
built-in and ``_target_`` optimizers, on CSX's traceable optimizers; recorded in checkpoints and checked on
resume; a pattern that matches nothing is an error naming it; the start line lists the groups.
The run is the tiny Blobs MLP of ``fixtures``: ``net.0`` (8 -> 16) and ``net.3`` (16 -> 4), with biases."""
import pytest
import torch

import csframework as csf
import fixtures
from csframework.errors import ConfigError
from fixtures import one_line

ADAMW = ["optimizer=adamw", "optimizer.lr=0.01", "optimizer.weight_decay=0.1", "optimizer.max_grad_norm=null"]
HEAD = ["+optimizer.groups.head.params=[net.3.*]", "+optimizer.groups.head.lr_scale=0.1"]


def build(tmp_path, *overrides, plugins=()):
    return csf.Run(fixtures.compose(*ADAMW, *overrides), output_dir=tmp_path, plugins=list(plugins))


def groups(run) -> dict[str, tuple[list[str], float]]:
    """Each torch param group of ``run``'s optimizer: its name -> (member names, weight decay)."""
    names = {id(p): n for n, p in run.model.named_parameters()}
    return {g["name"]: (sorted(names[id(p)] for p in g["params"]), g["weight_decay"])
            for g in run.optimizer.param_groups}


def test_by_default_biases_get_no_weight_decay(tmp_path):
    run = build(tmp_path)
    assert groups(run) == {"default": (["net.0.weight", "net.3.weight"], 0.1),
                           "no_decay": (["net.0.bias", "net.3.bias"], 0.0)}


def test_an_empty_exclusion_list_decays_every_parameter_as_before(tmp_path):
    run = build(tmp_path, "optimizer.weight_decay_exclude=[]")
    assert groups(run) == {"default": (["net.0.bias", "net.0.weight", "net.3.bias", "net.3.weight"], 0.1)}


def test_name_patterns_replace_or_join_the_dimension_rule(tmp_path):
    assert groups(build(tmp_path, "optimizer.weight_decay_exclude=[net.3.*]"))["no_decay"] == (
        ["net.3.bias", "net.3.weight"], 0.0)
    both = build(tmp_path / "both", "optimizer.weight_decay_exclude=['ndim<2',net.0.weight]")
    assert groups(both)["no_decay"] == (["net.0.bias", "net.0.weight", "net.3.bias"], 0.0)


def test_without_weight_decay_there_is_one_group(tmp_path):
    run = build(tmp_path, "optimizer.weight_decay=0.0")
    assert list(groups(run)) == ["default"]


def test_a_named_group_has_its_own_rate_through_the_schedule_and_keeps_the_exclusion(tmp_path):
    seen = []

    class Rates:
        @csf.hookimpl
        def on_before_optimizer_step(self, run, optimizer):
            seen.append({g["name"]: float(g["lr"]) for g in optimizer.param_groups})

    run = build(tmp_path, *HEAD, "optimizer.schedule.name=cosine", "optimizer.schedule.warmup_steps=2",
                "optimizer.schedule.min_lr=0.001", plugins=[Rates()])
    assert groups(run) == {"head": (["net.3.weight"], 0.1), "head/no_decay": (["net.3.bias"], 0.0),
                           "default": (["net.0.weight"], 0.1), "no_decay": (["net.0.bias"], 0.0)}
    run.fit()
    assert len({round(r["default"], 8) for r in seen}) > 3  # warm-up and decay: the rate changes
    for rates in seen:
        assert rates["head"] == pytest.approx(0.1 * rates["default"])
        assert rates["head/no_decay"] == rates["head"] and rates["no_decay"] == rates["default"]


def test_a_groups_own_weight_decay_applies_to_all_its_members(tmp_path):
    run = build(tmp_path, "+optimizer.groups.head.params=[net.3.*]", "+optimizer.groups.head.weight_decay=0.5")
    assert groups(run)["head"] == (["net.3.bias", "net.3.weight"], 0.5)


@pytest.mark.parametrize("override, key", [
    ("+optimizer.groups.head.params=[net.9.*]", "optimizer.groups.head.params"),
    ("optimizer.weight_decay_exclude=[encoder.*]", "optimizer.weight_decay_exclude"),
])
def test_a_pattern_that_matches_nothing_is_an_error_naming_it(tmp_path, override, key):
    with pytest.raises(ConfigError) as e:
        build(tmp_path, override)
    pattern = override.split("[")[1].rstrip("]")
    assert one_line(e.value).startswith(f"{key}: the pattern '{pattern}' matches no parameter")
    assert "net.0.weight" in str(e.value)


def test_a_target_optimizer_gets_the_groups(tmp_path):
    run = build(tmp_path, "+optimizer._target_=torch.optim.RMSprop", "optimizer.betas=null",
                "optimizer.eps=null", *HEAD)
    assert isinstance(run.optimizer, torch.optim.RMSprop)
    lrs = {g["name"]: g["lr"] for g in run.optimizer.param_groups}
    assert lrs["head"] == pytest.approx(0.1 * lrs["default"]) and lrs["default"] > 0
    assert groups(run)["no_decay"] == (["net.0.bias"], 0.0)


def test_the_start_line_lists_the_groups(tmp_path):
    run = build(tmp_path, *HEAD)
    run.fit()
    start = fixtures.events(tmp_path)[0]
    assert start["event"] == "fit_start"
    assert start["param_groups"] == ["head: 1 tensors, 64 params, weight_decay 0.1, lr x0.1",
                                     "head/no_decay: 1 tensors, 4 params, weight_decay 0, lr x0.1",
                                     "default: 1 tensors, 128 params, weight_decay 0.1",
                                     "no_decay: 1 tensors, 16 params, weight_decay 0"]


def test_resume_with_other_groups_is_refused(tmp_path):
    build(tmp_path, "checkpoint.every_steps=4").fit()
    again = build(tmp_path, "loop.max_steps=12", "checkpoint.resume=auto", *HEAD)
    with pytest.raises(csf.PluginError) as e:  # the checkpoint plugin's, which resumes
        again.fit()
    message = one_line(e.value)
    assert "does not fit this run: this run has the parameter group 'head'" in message
    assert "optimizer.weight_decay_exclude" in message
    # the same groups resume
    assert build(tmp_path, "loop.max_steps=12", "checkpoint.resume=auto").fit()["global_step"] == 12


def test_a_checkpoint_from_before_the_groups_resumes_only_with_one_group(tmp_path):
    from v1_checkpoint import v1_state

    old = build(tmp_path / "old", "optimizer.weight_decay_exclude=[]")
    state = v1_state(old)
    del state["param_groups"]  # as version 1 wrote it before groups were recorded
    with pytest.raises(ConfigError) as e:
        build(tmp_path / "new").load_state_dict(state)
    assert "it has 1 parameter group(s), this run 2" in str(e.value)
    assert "optimizer.weight_decay_exclude=[]" in str(e.value)
    build(tmp_path / "same", "optimizer.weight_decay_exclude=[]").load_state_dict(state)


def test_groups_on_csx_match_eager(tmp_path):
    """CSX's traceable AdamW applies each group's rate and weight decay as torch's does."""
    overrides = (*HEAD, "loop.max_steps=6", "precision=float32")
    eager = build(tmp_path / "eager", *overrides)
    eager.fit()
    csx = build(tmp_path / "csx", *overrides, "device=csx")
    csx.fit()
    for (name, a), (_, b) in zip(eager.model.named_parameters(), csx.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)
    # and the groups made a difference: without them the weights differ
    plain = build(tmp_path / "plain", "loop.max_steps=6", "optimizer.weight_decay_exclude=[]")
    plain.fit()
    assert not torch.allclose(plain.model.net[3].weight, eager.model.net[3].weight)


def test_invalid_group_settings_are_validation_errors():
    from csframework.errors import ValidationError

    with pytest.raises(ValidationError) as e:
        csf.Run(fixtures.compose(*ADAMW, "+optimizer.groups.head.params=[net.3.*]",
                                 "+optimizer.groups.head.lr_scale=-1"))
    assert "optimizer.groups.head.lr_scale" in str(e.value)


@pytest.mark.slow
def test_groups_compiled_match_eager(tmp_path):
    """backend.compile=true: the whole step's graph updates each group with its own rate and decay."""
    overrides = (*HEAD, "loop.max_steps=6", "backend.threads=1", "optimizer.schedule.warmup_steps=2")
    eager = build(tmp_path / "eager", *overrides)
    eager.fit()
    compiled = build(tmp_path / "compiled", *overrides, "backend.compile=true")
    assert compiled.fit()["compile"]["graph"] == "whole step"
    for (name, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_resume_with_the_same_groups_but_another_decay_goes_on_with_the_checkpoints_settings(tmp_path):
    """As for every optimizer setting: torch restores the saved group's decay (the checkpoint plugin warns)."""
    build(tmp_path, "checkpoint.every_steps=4").fit()
    again = build(tmp_path, "loop.max_steps=12", "checkpoint.resume=auto", "optimizer.weight_decay=0.3")
    assert again.fit()["global_step"] == 12
    assert {g["name"]: g["weight_decay"] for g in again.optimizer.param_groups} == {"default": 0.1, "no_decay": 0.0}
    assert any(e["event"] == "resume_settings_changed" for e in fixtures.events(tmp_path))

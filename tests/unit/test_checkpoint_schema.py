"""``csframework.builtin.checkpoint.schema``: one field list writes, reads, checks and loads a checkpoint's run
state; older layouts are converted by version (issue 51 item 4). Forged values: test_hostile_checkpoint_values.py."""
from __future__ import annotations

import json

import pytest
import torch

import csframework as csf
from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from csframework.builtin.checkpoint.schema import KEYS, STATE_VERSION, StateMismatch, upgrade

import fixtures
from fixtures import events, fit
from v1_checkpoint import v1_state, write_v1_checkpoint

STEADY = ["optimizer=adamw", "optimizer.lr=0.02", "+model.net.dropout=0.2", "loop.log_every=4"]


def built(tmp_path, *overrides):
    return csf.Run(fixtures.compose(*overrides), output_dir=tmp_path)


def test_every_field_is_written_even_when_the_run_has_no_such_part(tmp_path):
    state = built(tmp_path).state_dict()
    assert tuple(state) == KEYS and state["version"] == STATE_VERSION
    assert state["carried"] is None and state["data"] is None and state["sharded"] is False
    assert state["loop"]["stop_reason"] is None and state["loop"]["last_eval_step"] == -1


def test_meta_json_does_not_hold_the_step_a_second_time(tmp_path):
    fit(tmp_path, "loop.max_steps=2")
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    state, meta = read_checkpoint(newest)
    assert "global_step" not in meta and state["loop"]["global_step"] == 2
    assert csf.load_checkpoint(tmp_path).step == 2  # from the state's position


def test_a_version_1_checkpoint_on_disk_resumes_to_the_uninterrupted_result(tmp_path):
    """A checkpoint written by the version 1 writer (kept frozen in tests/support/v1_checkpoint.py) mid-run,
    the run then crashing: resuming it continues exactly as the run that was never interrupted."""
    class WriteV1ThenCrash:
        name = "v1_writer"

        @csf.hookimpl
        def on_train_step_end(self, run, step):
            if step == 4:
                write_v1_checkpoint(run)

        @csf.hookimpl
        def on_train_batch_end(self, run):
            if run.global_step == 5:
                raise RuntimeError("preempted")

    straight, _ = fit(tmp_path / "straight", "loop.max_steps=8", *STEADY)
    run_dir = tmp_path / "run"
    with pytest.raises(csf.PluginError, match="preempted"):
        fit(run_dir, "loop.max_steps=8", "checkpoint.every_steps=null", *STEADY, plugins=[WriteV1ThenCrash()])
    old = run_dir / "checkpoints" / "step-00000004"
    assert torch.load(old / "state.pt", weights_only=True)["version"] == 1
    assert json.loads((old / "meta.json").read_text())["global_step"] == 4
    resumed, summary = fit(run_dir, "loop.max_steps=8", "checkpoint.resume=auto", *STEADY)
    assert next(e for e in events(run_dir) if e["event"] == "resumed")["path"] == str(old)
    assert summary["status"] == "completed" and summary["global_step"] == 8
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(),
                                                 resumed.model.state_dict().values()))


def test_version_1_converts_to_this_layout_with_its_defaults(tmp_path):
    run = built(tmp_path)
    old = v1_state(run)
    del old["loop"]["last_eval_step"], old["param_groups"]  # the oldest checkpoints had neither
    state = upgrade(old)
    assert tuple(sorted(state)) == tuple(sorted(KEYS)) and state["version"] == STATE_VERSION
    assert state["loop"]["last_eval_step"] == -1 and state["param_groups"] is None
    assert state["carried"] is None and state["data"] is None and state["sharded"] is False
    run.load_state_dict(old)


@pytest.mark.parametrize("state, error, words", [
    ({"version": 3}, csf.ConfigError, "layout version 3, this csframework reads versions 1 to 2"),
    ({"model": {}}, csf.DamagedCheckpoint, "no layout version"),
    ([1, 2], csf.DamagedCheckpoint, "no layout version"),
    ({"version": 1, "loop": 3}, csf.DamagedCheckpoint, "not a run state of layout version 1"),
])
def test_a_state_of_no_known_layout_is_refused_in_one_line(state, error, words):
    with pytest.raises(error, match=words):
        upgrade(state)


def test_a_state_with_a_field_too_many_or_too_few_is_damaged(tmp_path):
    run = built(tmp_path)
    state = run.state_dict()
    with pytest.raises(csf.DamagedCheckpoint, match="unknown: planted"):
        run.load_state_dict({**state, "planted": 1})
    del state["rng"]
    with pytest.raises(csf.DamagedCheckpoint, match="missing: rng"):
        run.load_state_dict(state)


def test_run_load_state_dict_checks_the_values_before_loading_any(tmp_path):
    run = built(tmp_path)
    state = run.state_dict()
    state["loop"]["stage_step"] = 10**9
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    state["model"] = {k: v + 1 for k, v in state["model"].items()}
    with pytest.raises(csf.DamagedCheckpoint, match="loop.stage_step: 1000000000"):
        run.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())


def test_a_model_that_does_not_fit_is_named_once_by_its_tensor(tmp_path):
    state = built(tmp_path / "a").state_dict()
    with pytest.raises(StateMismatch) as info:
        built(tmp_path / "b", "model.net.hidden=32").load_state_dict(state)
    assert info.value.field == "model"
    assert str(info.value) == ("checkpoint: net.0.weight is [16, 8] in the checkpoint, [32, 8] in the model")


def test_a_sharded_state_holds_no_whole_model_and_loads_only_into_a_sharded_run(tmp_path, monkeypatch):
    """Under ``strategy=fsdp`` the ranks write the model and optimizer into ``sharded/`` (tests/e2e/test_fsdp.py
    runs it under torchrun); the state has them as ``None``, and a whole run refuses it naming the strategy."""
    run = built(tmp_path / "a")
    monkeypatch.setattr(run.backend, "sharded", True)
    state = run.state_dict()
    assert state["sharded"] is True and state["model"] is None and state["optimizer"] is None
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.load_state_dict(state)  # the checkpoint plugin then loads the shards (Backend.load_sharded)
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    with pytest.raises(StateMismatch, match=r"written sharded \(strategy=fsdp\); resume it with the same kind"):
        built(tmp_path / "b").load_state_dict(state)


def test_another_model_is_named_by_its_tensors_not_by_its_optimizer_groups(tmp_path):
    """A checkpoint of another model (other parameter names) into a run: its parameter groups differ too, but
    what to fix is the model (a newcomer validating with the wrong model= was told to change
    optimizer.groups)."""
    state = built(tmp_path / "a").state_dict()
    with pytest.raises(StateMismatch) as info:
        built(tmp_path / "b", "model=tiny_linear", "model.net.in_features=8").load_state_dict(state)
    assert info.value.field == "model"
    assert "the checkpoint has net.0.weight (+3 more) which the model lacks" in str(info.value)
    assert "optimizer.groups" not in str(info.value)

"""``csframework.state.RunState``: the loop's position, stop request and pending outputs, written through its methods."""
import torch

from csframework.state import RunState


def test_a_step_of_two_micro_batches_advances_the_position_once():
    state = RunState()
    assert state.start_batch(2) is False
    state.end_batch(False)
    assert (state.micro_step, state.batch_in_epoch, state.global_step) == (1, 1, 0)
    assert state.start_batch(2) is True
    state.end_batch(True)
    assert (state.micro_step, state.batch_in_epoch, state.global_step, state.stage_step) == (2, 2, 1, 1)
    state.next_epoch()
    assert (state.epoch, state.batch_in_epoch) == (1, 0)
    state.enter_stage(1)
    assert (state.global_step, state.stage_index, state.stage_step, state.epoch, state.batch_in_epoch,
            state.micro_step, state.last_eval_step) == (1, 1, 0, 0, 0, 0, -1)


def test_only_the_first_stop_request_is_recorded():
    state = RunState()
    assert state.request_stop(15) is True and state.request_stop(2) is False
    assert state.stop_signal == 15 and not state.stopping
    state.stop_after_this_step()
    assert state.stopping and state.stop_signal == 15
    state.reset_stop()
    assert (state.stop_signal, state.stopping) == (None, False)


def test_only_scalar_outputs_are_kept_until_the_log_and_the_hooks_get_them_detached():
    state = RunState()
    weight = torch.ones(3, requires_grad=True)
    loss, logits, labels = (weight * 2).sum(), weight * 3, torch.tensor([1, 2])
    kept = state.keep_outputs({"loss": loss, "logits": logits, "labels": labels, "name": "x"})
    assert list(kept) == ["loss", "logits", "labels", "name"]
    assert not kept["loss"].requires_grad and not kept["logits"].requires_grad
    assert kept["labels"] is labels and kept["name"] == "x"  # nothing to detach: passed as it is
    assert list(state.pending) == ["loss"] and state.pending["loss"][0] is kept["loss"]
    state.keep_outputs({"loss": torch.tensor(2.0)})
    assert [float(v) for v in state.pending["loss"]] == [6.0, 2.0]
    state.clear_pending()
    assert state.pending == {}

"""``csframework.state.RunState``: the loop's position, stop request and pending outputs, written through its methods."""
import torch

from csframework.state import RunState, window


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


class OnDevice(torch.Tensor):
    """A tensor that is not in host memory, as on a GPU."""

    @property
    def is_cpu(self) -> bool:
        return False


def test_only_scalar_outputs_are_kept_until_the_log_read_on_the_host_and_detached_on_a_device():
    state = RunState()
    weight = torch.ones(3, requires_grad=True)
    loss, logits, labels = (weight * 2).sum(), weight * 3, torch.tensor([1, 2])
    outputs = {"loss": loss, "logits": logits, "labels": labels, "accuracy": torch.tensor(0.5), "name": "x"}
    state.keep_outputs(outputs)
    assert list(state.pending) == ["loss", "accuracy"]  # 0-d tensors only, in the step's order
    assert state.pending["loss"] == [6.0] and type(state.pending["loss"][0]) is float  # read on the host
    assert outputs["loss"] is loss and loss.requires_grad  # the outputs themselves are left as they are
    on_device = ((weight * 2).sum() / 3).as_subclass(OnDevice)
    state.keep_outputs({"loss": on_device})
    kept = state.pending["loss"][1]
    assert isinstance(kept, torch.Tensor) and not kept.requires_grad  # not read: detached, out of the graph
    assert window(state.pending["loss"]).tolist() == [6.0, 2.0] and window([1, 2]).dtype == torch.float32
    state.clear_pending()
    assert state.pending == {}

"""``csframework.backends.csx.graph``: the clean-up of a traced graph keeps the step's work.

A training step's work is in-place updates whose results nothing uses (``param.add_``, the optimizer's state);
on torch 2.4, torch.fx's dead-code pass erased them, and with them the backward pass (issue 31 item 4)."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from csframework.graph import passes as graph


def test_clean_up_keeps_in_place_updates_whose_results_are_unused():
    def step(weight, x):
        loss = (weight * x).sum()
        weight.sub_(0.5 * x)  # the update: its result is not used
        (weight * 2).sum()    # dead code
        return loss

    gm = graph.postprocess(make_fx(step, tracing_mode="fake")(torch.ones(3), torch.ones(3)))
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.sub_.Tensor" in ops and ops.count("aten.sum.default") == 1
    weight = torch.ones(3)
    loss = gm(weight, torch.tensor([1.0, 2.0, 4.0]))
    assert loss.item() == 7.0 and weight.tolist() == [0.5, 0.0, -1.0]

"""Model wrappers that adapt plain networks to the model contract."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelError

LOSSES = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss, "l1": F.l1_loss}
#: The named losses that compare the prediction with the target element by element: their shapes must match.
ELEMENTWISE = ("mse", "l1")


class Supervised(nn.Module):
    """``Supervised(net=..., loss="cross_entropy")``: ``forward((inputs, targets))`` returns
    ``{"loss", "logits", "labels", "preds"}`` (``labels``: the targets; ``preds``: the predicted classes for
    ``cross_entropy``, the net's output for a regression loss), plus ``accuracy`` for classification.
    ``forward(inputs)`` (a batch without targets, as ``data.predict`` may hold) returns
    ``{"logits", "preds"}``. ``loop.collect=[preds,labels]`` collects a whole evaluation.

    ``loss`` is a name in ``LOSSES`` or a callable ``loss(outputs, targets)``. With ``mse`` and ``l1`` the
    net's output must have the targets' shape (torch would broadcast a ``(B, 1)`` output against ``(B,)``
    targets into a ``(B, B)`` loss, silently wrong): ``squeeze=true`` drops a last dimension of size 1 from
    the output (``Linear(n, 1)`` against targets of shape ``(B,)``).
    """

    def __init__(self, net: nn.Module, loss: Union[str, Callable] = "cross_entropy", squeeze: bool = False):
        super().__init__()
        if isinstance(loss, str) and loss not in LOSSES:
            raise ValueError(f"model.loss: unknown loss {loss!r}; use one of {sorted(LOSSES)} or a callable")
        self.net = net
        self.classify = loss == "cross_entropy"
        self.elementwise = isinstance(loss, str) and loss in ELEMENTWISE
        self.loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "loss")
        self.squeeze = squeeze
        self.loss_fn = LOSSES[loss] if isinstance(loss, str) else loss

    def forward(self, batch):
        inputs, targets = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (_inputs(batch), None)
        logits = self.net(inputs)
        if self.squeeze and logits.ndim > 1 and logits.shape[-1] == 1:
            logits = logits.squeeze(-1)
        preds = logits.detach().argmax(-1) if self.classify else logits.detach()
        if targets is None:  # a prediction set: nothing to compare with
            return {"logits": logits, "preds": preds}
        if self.elementwise and logits.shape != targets.shape:
            raise ModelError(_shape_problem(self.loss_name, tuple(logits.shape), tuple(targets.shape)))
        out = {"loss": self.loss_fn(logits, targets), "logits": logits, "labels": targets, "preds": preds}
        if self.classify:
            out["accuracy"] = (preds == targets).float().mean()
        return out


def _inputs(batch):
    """The inputs of a batch without targets: the batch itself, or the one element of a 1-tuple."""
    return batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 1 else batch


def _shape_problem(loss: str, prediction: tuple, target: tuple) -> str:
    """The one line for a prediction whose shape is not its target's, with the fix that fits."""
    if prediction[:-1] == target and prediction[-1:] == (1,):
        fix = ("set model.squeeze=true (drops the output's last dimension of size 1), or give targets of shape "
               f"{list(prediction)}")
    else:
        fix = "make the net's output the targets' shape (model.net's last layer) or reshape the targets"
    return (f"model.loss={loss}: the net's output has shape {list(prediction)} and the targets {list(target)}; "
            f"torch would broadcast them into a wrong loss; {fix}")

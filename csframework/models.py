"""Model wrappers that adapt plain networks to the model contract."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

LOSSES = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss, "l1": F.l1_loss}


class Supervised(nn.Module):
    """``Supervised(net=..., loss="cross_entropy")``: ``forward((inputs, targets))`` returns
    ``{"loss", "logits", "labels"}`` (``labels``: the targets), plus ``preds`` (the predicted classes) and
    ``accuracy`` for classification losses. ``loop.collect=[preds,labels]`` collects a whole evaluation.

    ``loss`` is a name in ``LOSSES`` or a callable ``loss(outputs, targets)``.
    """

    def __init__(self, net: nn.Module, loss: Union[str, Callable] = "cross_entropy"):
        super().__init__()
        if isinstance(loss, str) and loss not in LOSSES:
            raise ValueError(f"model.loss: unknown loss {loss!r}; use one of {sorted(LOSSES)} or a callable")
        self.net = net
        self.classify = loss == "cross_entropy"
        self.loss_fn = LOSSES[loss] if isinstance(loss, str) else loss

    def forward(self, batch):
        inputs, targets = batch
        logits = self.net(inputs)
        out = {"loss": self.loss_fn(logits, targets), "logits": logits}
        out["labels"] = targets
        if self.classify:
            out["preds"] = logits.detach().argmax(-1)
            out["accuracy"] = (out["preds"] == targets).float().mean()
        return out

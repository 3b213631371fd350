"""Nets for the fidelity tests (``model.net._target_=fidelity_nets.<Net>``): each reads a tensor's value in
the step, which a static graph cannot do."""
import torch


class ItemNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        scale = 1.0 if y.sum().item() > -1e9 else 2.0  # data-dependent Python: .item()
        return y * scale


class BoolNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        if y.mean() > -1e9:  # data-dependent Python: bool(tensor)
            y = y * 1.0
        return y

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


class TolistNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        first = y.sum(0).tolist()  # data-dependent Python: .tolist()
        return y * (1.0 if first[0] > -1e9 else 2.0)


class CpuNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        host = y.cpu()  # a tensor moved to the host inside the step
        return host * 1.0


class NonzeroNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        picked = torch.nonzero(y > 0)  # an output shape that depends on the values
        return y + picked.float().sum() * 0.0


class MaskNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        kept = y[y > 0]  # boolean indexing: a value-dependent shape
        return y + kept.sum() * 0.0


class DetNet(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return y + torch.linalg.det(y[:3, :3]) * 0.0  # an operation without a Cerebras lowering

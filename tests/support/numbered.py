"""Numbered samples for the dataset tests: iterable, stateful-iterable and map-style datasets whose samples
carry their id, a user collate_fn, and a model that records the ids of every training batch (in process, and
to ``$SEEN_DIR/rank-<RANK>.txt`` for subprocesses)."""
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

N, DIM, CLASSES = 64, 8, 4


def _samples(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


class Numbered(IterableDataset):
    """``n`` numbered samples, in an order that is a function of the epoch (``set_epoch``)."""

    def __init__(self, n: int = N):
        self.x, self.y = _samples(n)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(len(self.y), generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield {"id": i, "x": self.x[i], "y": self.y[i]}


class StatefulNumbered(Numbered):
    """A stream that cannot be re-read: it resumes from its own ``state_dict`` (the samples it has given)."""

    def __init__(self, n: int = N):
        super().__init__(n)
        self.given = 0
        self.loaded = []

    def __iter__(self):
        while self.given < len(self.y):
            i = self.given
            self.given += 1
            yield {"id": i, "x": self.x[i], "y": self.y[i]}
        self.given = 0

    def state_dict(self):
        return {"given": self.given}

    def load_state_dict(self, state):
        self.loaded.append(state)
        self.given = state["given"]


class NumberedMap(Dataset):
    def __init__(self, n: int = N):
        self.x, self.y = _samples(n)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"id": i, "x": self.x[i], "y": self.y[i]}


def collate(samples, scale=1.0):
    """A user's collate_fn: stacks the dicts and scales the inputs (scale is set from config)."""
    return {"id": torch.tensor([s["id"] for s in samples]), "x": torch.stack([s["x"] for s in samples]) * scale,
            "y": torch.stack([s["y"] for s in samples]), "scale": torch.tensor(scale)}


class Seen(nn.Module):
    """A linear classifier that records the ids of every training batch (in ``seen``, and appended to
    ``$SEEN_DIR/rank-<RANK>.txt`` when that is set) and the collate scale it was given."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(DIM, CLASSES)
        self.seen, self.scales = [], set()

    def forward(self, batch):
        if self.training:
            self.seen.append(batch["id"].tolist())
            self.scales.add(float(batch["scale"]))
            if os.environ.get("SEEN_DIR"):
                with open(Path(os.environ["SEEN_DIR"]) / f"rank-{os.environ.get('RANK', 0)}.txt", "a") as f:
                    f.write(" ".join(map(str, batch["id"].tolist())) + "\n")
        return nn.functional.cross_entropy(self.net(batch["x"]), batch["y"])


def write_conf(root: Path) -> str:
    """A user config directory at ``root``: model=seen, data=numbered (iterable) and data=numbered_map, both
    with the collate_fn above (scale 2)."""
    (root / "model").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "model" / "seen.yaml").write_text(f"_target_: {__name__}.Seen\n")
    for name, cls in (("numbered", "Numbered"), ("numbered_map", "NumberedMap")):
        (root / "data" / f"{name}.yaml").write_text(
            f"train: {{_target_: {__name__}.{cls}}}\nval: null\nbatch_size: 8\nshuffle: true\n"
            f"collate_fn: {{_target_: {__name__}.collate, scale: 2.0}}\n")
    return str(root)

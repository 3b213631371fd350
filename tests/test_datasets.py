"""Any dataset: a custom ``collate_fn``, ``IterableDataset``s sharded across loader workers and DDP ranks
(each sample read once per epoch, resumable), and the loader settings ``pin_memory``,
``persistent_workers``, ``prefetch_factor``."""
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import csframework as csf
from csframework.errors import ValidationError

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


@pytest.fixture
def conf(tmp_path):
    """A user config directory: model=seen, data=numbered (iterable) and data=numbered_map."""
    root = tmp_path / "conf"
    (root / "model").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "model" / "seen.yaml").write_text(f"_target_: {__name__}.Seen\n")
    for name, cls in (("numbered", "Numbered"), ("numbered_map", "NumberedMap")):
        (root / "data" / f"{name}.yaml").write_text(
            f"train: {{_target_: {__name__}.{cls}}}\nval: null\nbatch_size: 8\nshuffle: true\n"
            f"collate_fn: {{_target_: {__name__}.collate, scale: 2.0}}\n")
    return root


def run(conf, tmp_path, *overrides, name="run"):
    cfg = csf.compose(["model=seen", "data=numbered", "loop.max_steps=16", "loop.eval_every=null",
                       "loop.log_every=4", "optimizer=sgd", "optimizer.lr=0.1", *overrides], config_dir=str(conf))
    r = csf.Run(cfg, output_dir=tmp_path / name)
    r.fit()
    return r


def epochs(seen, per_epoch):
    """The sample ids of each epoch, from the per-batch id lists."""
    flat = [i for batch in seen for i in batch]
    return [flat[k:k + per_epoch] for k in range(0, len(flat), per_epoch)]


@pytest.mark.parametrize("data", ["numbered", "numbered_map"])
def test_custom_collate_and_two_workers_read_each_sample_once_per_epoch(conf, tmp_path, data):
    extra = ["data.persistent_workers=true", "data.prefetch_factor=3"] if data == "numbered_map" else []
    workers = run(conf, tmp_path, f"data={data}", "data.num_workers=2", *extra, name="workers")
    assert workers.model.scales == {2.0}, "the collate_fn and its configured argument were used"
    seen = epochs(workers.model.seen, N)
    assert len(seen) == 2 and all(sorted(ids) == list(range(N)) for ids in seen)
    assert seen[0] != seen[1], "the order changes with the epoch"
    assert not multiprocessing.active_children(), "the workers (persistent ones too) end with the fit"
    single = run(conf, tmp_path, f"data={data}", name="single")
    assert single.model.seen == workers.model.seen, "workers make the batches one process makes"


def test_an_iterable_dataset_resumes_from_the_middle_of_an_epoch_exactly(conf, tmp_path):
    common = ["data.num_workers=2", "loop.max_steps=12", "checkpoint.every_steps=5"]
    straight = run(conf, tmp_path, *common, name="straight")
    resumed = run(conf, tmp_path, *common, name="resumed",
                  *[f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000010'}"])
    assert resumed.model.seen == straight.model.seen[10:]
    for (key, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key


def test_a_stateful_iterable_dataset_is_restored_from_its_state_dict(conf, tmp_path):
    common = [f"data.train._target_={__name__}.StatefulNumbered", "loop.max_steps=12", "checkpoint.every_steps=5",
              "checkpoint.keep_last=3"]
    straight = run(conf, tmp_path, *common, name="straight")
    resumed = run(conf, tmp_path, *common, name="resumed",
                  *[f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000005'}"])
    assert resumed.train_loader.dataset.dataset.loaded == [{"given": 40}]
    assert resumed.model.seen == straight.model.seen[5:]


@pytest.mark.parametrize("overrides, message", [
    (["data.prefetch_factor=2"], "data.prefetch_factor: needs loader workers"),
    (["data.persistent_workers=true"], "data.persistent_workers: needs loader workers"),
    (["data.num_workers=1", "data.prefetch_factor=0"], "data.prefetch_factor: 0 must be"),
    (["~data.collate_fn._target_"], "data.collate_fn: needs a _target_"),
])
def test_loader_settings_are_validated(conf, tmp_path, overrides, message):
    with pytest.raises(ValidationError) as caught:
        run(conf, tmp_path, *overrides)
    assert any(p.startswith(message) for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("overrides, message", [
    (["loop.max_steps=null", "loop.max_epochs=1"], "loop.max_steps: data.train is an IterableDataset"),
    (["data.num_workers=1", "data.persistent_workers=true"], "data.persistent_workers: an IterableDataset"),
    (["data.collate_fn._target_=builtins.nothing_here"], "data.collate_fn: could not build"),
])
def test_iterable_dataset_errors_name_the_key(conf, tmp_path, overrides, message):
    with pytest.raises(csf.ConfigError, match=message):
        run(conf, tmp_path, *overrides)


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
@pytest.mark.parametrize("data", ["numbered", "numbered_map"])
def test_two_ddp_ranks_with_workers_read_each_sample_once_per_epoch(conf, tmp_path, cli_env, data):
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    env = dict(cli_env, SEEN_DIR=str(seen_dir))
    # 64 samples, 2 ranks x batch 8: 4 steps per epoch; 8 steps are 2 epochs
    done = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", "--config-dir", str(conf),
                           "model=seen", f"data={data}", "data.num_workers=2", "loop.max_steps=8",
                           "loop.log_every=4", "optimizer=sgd", "backend.strategy=ddp",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [[[int(i) for i in line.split()] for line in (seen_dir / f"rank-{r}.txt").read_text().splitlines()]
             for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [8, 8]
    for epoch in range(2):
        shares = [[i for batch in batches[4 * epoch: 4 * epoch + 4] for i in batch] for batches in ranks]
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(N)), f"epoch {epoch}"

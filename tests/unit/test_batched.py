"""The batched fast path (``csframework.batched``): a ``TensorDataset``, or a dataset with ``__getbatch__``,
is read a whole batch at a time, and gives the very batches the per-sample path (``__getitem__`` and
``default_collate``) gives, in the same order, from the same resume position, with loader workers too; a
run trains to the same parameters either way and resumes exactly in the middle of an epoch."""
from __future__ import annotations

import multiprocessing
import time
import warnings

import pytest
import torch
from torch.utils.data import Subset, TensorDataset, default_collate, random_split

import csframework as csf
from csframework.batched import BatchReader
from csframework.data import epoch_batches, make_loader
from csframework.defaults import StdlibText
from csframework.defaults.tiny import Clusters
from csframework.errors import DataTimeoutError

import fixtures


def dataset(n: int = 103) -> TensorDataset:
    """Tensors of several dtypes and shapes, one of them not contiguous."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g),
                         torch.randint(0, 255, (n, 2, 3), generator=g).to(torch.uint8),
                         torch.randn(4, n, generator=g).t())


def passes(data, batched: bool, epochs=((0, 0), (1, 0)), batch_size: int = 8, **options) -> tuple[list, object]:
    """The batches of ``epochs`` ((epoch, start batch) pairs) of a loader over ``data``, and the loader."""
    settings = dict(shuffle=True, seed=3, num_workers=0, drop_last=True) | options
    loader = make_loader(data, batch_size, batched_fetch=batched, **settings)
    try:
        return [batch for epoch, start in epochs for batch in epoch_batches(loader, epoch, start)], loader
    finally:
        loader.close()


def assert_same_batches(plain: list, fast: list) -> None:
    assert len(plain) == len(fast) > 0
    for i, (a, b) in enumerate(zip(plain, fast)):
        assert type(a) is type(b) and len(a) == len(b), i
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), i
            assert x.is_contiguous() and y.is_contiguous(), i


@pytest.mark.parametrize("options", [
    {},
    {"drop_last": False},
    {"shuffle": False},
    {"rank": 1, "world_size": 3},
    {"rank": 2, "world_size": 3, "pad": True, "drop_last": False, "shuffle": False},  # evaluation
    {"epochs": ((0, 3), (1, 0), (2, 11))},  # resumed in the middle of an epoch, and at its last batch
    {"epochs": ((0, 12), (1, 0))},  # resumed after the last batch: no batch in that epoch
    {"drop_last": False, "epochs": ((0, 13), (1, 0))},
    {"num_workers": 2, "epochs": ((0, 0), (1, 5))},
    {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 3},
    {"pin_memory": True},
], ids=["default", "keep-last", "in-order", "rank-1-of-3", "eval-pad", "resume", "resume-at-end",
        "resume-at-end-keep-last", "workers", "persistent", "pin-memory"])
def test_the_fast_path_gives_the_batches_of_the_per_sample_path(options):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        plain, plain_loader = passes(dataset(), False, **options)
        fast, fast_loader = passes(dataset(), True, **options)
    assert not isinstance(plain_loader.dataset, BatchReader) and isinstance(fast_loader.dataset, BatchReader)
    assert len(fast_loader) == len(plain_loader)
    assert_same_batches(plain, fast)
    assert isinstance(fast[0], list), "default_collate makes a list of a tuple sample's fields"
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("chunk_bytes", [1, 700, 2**30], ids=["one-batch", "3-batches", "whole-epoch"])
@pytest.mark.parametrize("options", [{}, {"drop_last": False}, {"epochs": ((0, 4), (1, 0))}],
                         ids=["default", "keep-last", "resume"])
def test_reading_ahead_across_chunk_boundaries_gives_the_same_batches(monkeypatch, chunk_bytes, options):
    """A plain TensorDataset pass reads several batches per index_select (READ_AHEAD_BYTES); a batch split
    across chunk ends, a short last batch and a resumed start must still come out exactly."""
    monkeypatch.setattr("csframework.batched.READ_AHEAD_BYTES", chunk_bytes)
    plain, _ = passes(dataset(), False, **options)
    fast, _ = passes(dataset(), True, **options)
    assert_same_batches(plain, fast)


class Overrides(TensorDataset):
    def __getitem__(self, i):
        return tuple(t[i] * 2 for t in self.tensors)


class GetItems(TensorDataset):
    def __getitems__(self, indices):
        return [self[i] for i in indices]


class Plain(TensorDataset):
    """A subclass that changes no reading: still a TensorDataset's samples."""


class Records:
    """A user collate_fn."""

    def __call__(self, samples):
        return default_collate(samples)


@pytest.mark.parametrize("data, options, batched", [
    (TensorDataset(torch.arange(32.)), {}, True),
    (Plain(torch.arange(32.)), {}, True),
    (Overrides(torch.arange(32.)), {}, False),
    (GetItems(torch.arange(32.)), {}, False),
    (fixtures.Blobs(32), {}, False),
    (fixtures.AugmentedBlobs(32), {}, True),
    (TensorDataset(torch.arange(32.)), {"collate_fn": Records()}, False),
    (TensorDataset(torch.arange(32.)), {"batched_fetch": False}, False),
], ids=["TensorDataset", "subclass", "own-getitem", "own-getitems", "plain-dataset", "getbatch", "collate_fn",
        "switched-off"])
def test_which_datasets_take_the_fast_path(data, options, batched):
    loader = make_loader(data, 4, **({"shuffle": True, "seed": 0, "num_workers": 0, "drop_last": True,
                                      "batched_fetch": True} | options))
    assert isinstance(loader.dataset, BatchReader) is batched
    assert len(loader) == 8 and loader.samples_per_batch == 4


class DictSamples(torch.utils.data.Dataset):
    """Dict samples, and the ``__getbatch__`` that returns what default_collate makes of them."""

    def __init__(self, n: int = 50):
        self.x, self.y = torch.randn(n, 3), torch.arange(n)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "pair": (self.y[i], self.x[i, 0])}

    def __getbatch__(self, indices):
        return {"x": self.x[indices], "y": self.y[indices], "pair": [self.y[indices], self.x[indices, 0]]}


def test_a_getbatch_dataset_is_read_a_batch_at_a_time():
    data = DictSamples()
    plain, _ = passes(data, False, drop_last=False)
    fast, loader = passes(data, True, drop_last=False)
    assert loader.reader() == "DictSamples.__getbatch__"
    assert len(plain) == len(fast) == 14
    for a, b in zip(plain, fast):
        assert a.keys() == b.keys() and type(a["pair"]) is type(b["pair"]) is list
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
        assert all(torch.equal(p, q) for p, q in zip(a["pair"], b["pair"]))


BUILT_IN = {"StdlibText": lambda: StdlibText(split="val", block_size=16, num_chars=20_000),  # 124 windows
            "Clusters": lambda: Clusters(n=101, dim=5, classes=4)}


@pytest.mark.parametrize("options", [{}, {"drop_last": False, "shuffle": False}, {"epochs": ((0, 5), (1, 0))},
                                     {"rank": 1, "world_size": 2, "pad": True, "drop_last": False},
                                     {"num_workers": 2, "epochs": ((0, 0), (1, 3))}])
@pytest.mark.parametrize("name", list(BUILT_IN))
def test_the_built_in_datasets_read_whole_batches_of_the_same_samples(name, options):
    plain, _ = passes(BUILT_IN[name](), False, **options)
    fast, loader = passes(BUILT_IN[name](), True, **options)
    assert loader.reader() == f"{name}.__getbatch__"
    assert_same_batches(plain, fast)


class OwnSubset(Subset):
    def __getitem__(self, i):
        return self.dataset[self.indices[i]][0] * 2

    def __getitems__(self, indices):  # torch requires it of a Subset that overrides __getitem__
        return [self[i] for i in indices]


def split(data, n: int = 32):
    """The first part of ``random_split(data, [n, rest])``: a Subset of shuffled indices."""
    return random_split(data, [n, len(data) - n], generator=torch.Generator().manual_seed(0))[0]


@pytest.mark.parametrize("data, batched", [
    (split(TensorDataset(torch.arange(40.))), True),
    (Subset(split(TensorDataset(torch.arange(40.)), 36), list(range(32))), True),  # a split of a split
    (split(fixtures.AugmentedBlobs(40)), True),
    (split(fixtures.Blobs(40)), False),
    (OwnSubset(TensorDataset(torch.arange(40.)), list(range(32))), False),
    (Subset(TensorDataset(torch.arange(40.)), list(range(31)) + [40]), False),  # an index past the end
    (Subset(TensorDataset(torch.arange(40.)), [0.5] * 32), False),  # not integers
    (Subset(TensorDataset(torch.arange(40.)), torch.arange(32, dtype=torch.uint8)), False),  # a mask to torch
], ids=["random_split", "nested", "getbatch", "plain-dataset", "own-getitem", "out-of-range", "float-indices",
        "uint8-indices"])
def test_which_subsets_take_the_fast_path(data, batched):
    test_which_datasets_take_the_fast_path(data, {}, batched)


SUBSETS = {
    # shuffled, with a repeated and a negative index (dataset[-1] is the last sample on the per-sample path)
    "TensorDataset": lambda: Subset(dataset(), [*torch.randperm(103, generator=torch.Generator().manual_seed(1))
                                                .tolist()[:90], 5, 5, -1, -103]),
    "nested": lambda: Subset(split(dataset(), 80), torch.arange(79, -1, -1)),
    "getbatch": lambda: Subset(DictSamples(), range(10, 45)),
}


@pytest.mark.parametrize("options", [{}, {"drop_last": False, "shuffle": False}, {"epochs": ((0, 4), (1, 0))},
                                     {"rank": 1, "world_size": 3, "pad": True, "drop_last": False},
                                     {"num_workers": 2, "epochs": ((0, 0), (1, 2))}],
                         ids=["default", "in-order", "resume", "eval-pad", "workers"])
@pytest.mark.parametrize("name", list(SUBSETS))
def test_a_subset_reads_whole_batches_of_the_same_samples(name, options, monkeypatch):
    monkeypatch.setattr("csframework.batched.READ_AHEAD_BYTES", 700)  # reads ahead across several batches
    data = SUBSETS[name]()
    plain, _ = passes(data, False, **options)
    fast, loader = passes(data, True, **options)
    assert isinstance(loader.dataset, BatchReader)
    if name == "getbatch":
        assert loader.reader() == "Subset of DictSamples.__getbatch__"
        assert all(torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]) for a, b in zip(plain, fast))
        assert len(plain) == len(fast) > 0
    else:
        nested = "Subset of " if name == "nested" else ""
        assert loader.reader() == f"Subset of {nested}TensorDataset (index_select)"
        assert_same_batches(plain, fast)


def test_the_text_targets_are_the_inputs_shifted_by_one_byte():
    inputs, targets = BUILT_IN["StdlibText"]().__getbatch__(torch.tensor([3, 0, 7]))
    assert inputs.shape == targets.shape == (3, 16) and torch.equal(targets[:, :-1], inputs[:, 1:])


def test_a_getbatch_that_is_not_a_method_is_refused():
    data = DictSamples()
    data.__getbatch__ = 3
    with pytest.raises(TypeError, match=r"DictSamples.__getbatch__ is a int, not a method; define "
                                        r"__getbatch__\(self, indices\)"):
        make_loader(data, 4, shuffle=False, seed=0, num_workers=0, drop_last=False)


class Returns(DictSamples):
    """A ``__getbatch__`` that returns ``make(self, indices)``."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __getbatch__(self, indices):
        return self.make(self, indices)


@pytest.mark.parametrize("make, error", [
    (lambda d, i: None, r"Returns.__getbatch__ returned None; it must return the collated batch, as tensors"),
    (lambda d, i: [d.x[i].numpy(), d.y[i].numpy()], r"Returns.__getbatch__ returned NumPy arrays"),
    (lambda d, i: [d.x[i][:-1], d.y[i]], r"Returns.__getbatch__ returned 3 rows for 4 indices; it must return one "
                                         r"row per index"),
    (lambda d, i: {"n": torch.tensor(len(i)), "x": d.x[i]}, r"Returns.__getbatch__ returned a 0-d tensor for 4"),
], ids=["none", "numpy", "a-row-short", "0-d"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_getbatch_that_returns_no_batch_of_its_indices_is_named(make, error, workers):
    loader = make_loader(Returns(make), 4, shuffle=False, seed=0, num_workers=workers, drop_last=False)
    with pytest.raises((TypeError, ValueError), match=error):
        next(iter(loader))
    loader.close()


def test_a_getbatch_batch_may_hold_strings_before_its_tensors():
    data = Returns(lambda d, i: {"names": [f"s{k}" for k in i.tolist()], "x": d.x[i]})
    batches, _ = passes(data, True, drop_last=False)
    assert batches[0]["names"] and len(batches[0]["x"]) == 8
    only_strings = Returns(lambda d, i: [f"s{k}" for k in i.tolist()])  # the model's business
    assert len(passes(only_strings, True, drop_last=False)[0]) == 2 * 7  # two epochs of 50 samples in 8s


def test_workers_seed_each_batch_so_a_resumed_pass_reads_the_same_augmentations():
    data = fixtures.AugmentedBlobs(64)
    straight, _ = passes(data, True, epochs=((1, 0),), num_workers=2)
    resumed, _ = passes(data, True, epochs=((1, 3),), num_workers=2)
    assert_same_batches(straight[3:], resumed)
    again, _ = passes(data, True, epochs=((2, 0),), num_workers=2)
    assert not torch.equal(again[0][0], straight[0][0]), "each epoch draws new augmentations"


class Hangs(DictSamples):
    def __getbatch__(self, indices):
        time.sleep(60)


def test_a_worker_stuck_in_getbatch_is_named_and_stopped():
    loader = make_loader(Hangs(), 4, shuffle=False, seed=0, num_workers=1, drop_last=False, timeout_s=1,
                         role="data.train")
    with pytest.raises(DataTimeoutError, match=r"^data.train: loader worker 0 \(pid \d+\) gave no batch in 1 s "
                                               r"\(data.timeout_s\) and was stopped: Hangs.__getbatch__ hangs"):
        next(iter(loader))
    loader.close()
    assert not multiprocessing.active_children()


# -- whole runs ------------------------------------------------------------------------------------------------
class Losses:
    """Records the loss of every training step and the final evaluation metrics."""

    name = "losses"

    def __init__(self):
        self.train, self.val = [], {}

    @csf.hookimpl
    def on_train_batch_end(self, outputs):
        self.train.append(float(outputs["loss"]))

    @csf.hookimpl
    def on_eval_end(self, metrics):
        self.val = dict(metrics)


STEADY = ["data.train._target_=fixtures.tensor_blobs", "data.val._target_=fixtures.tensor_blobs",
          "optimizer=adamw", "optimizer.lr=0.02", "+model.net.dropout=0.2", "loop.log_every=4"]


def fit(tmp_path, *overrides):
    losses = Losses()
    run = csf.Run(fixtures.compose(*STEADY, *overrides), output_dir=tmp_path, plugins=[losses])
    summary = run.fit()
    assert summary["status"] == "completed"
    return run, losses


def params(run) -> dict:
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def assert_same_params(a, b) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra", [[], ["data.num_workers=2", "data.batch_size=24", "data.drop_last=false"]],
                         ids=["in-process", "workers"])
def test_a_run_trains_the_same_with_and_without_the_fast_path(tmp_path, extra):
    common = ["loop.max_steps=20", "loop.eval_every=10", "data.eval_batch_size=24", *extra]
    fast, fast_losses = fit(tmp_path / "fast", *common)
    plain, plain_losses = fit(tmp_path / "plain", *common, "data.batched_fetch=false")
    assert isinstance(fast.train_loader.dataset, BatchReader) and isinstance(fast.val_loader.dataset, BatchReader)
    assert not isinstance(plain.train_loader.dataset, BatchReader)
    assert len(fast_losses.train) == 20 and fast_losses.train == plain_losses.train
    assert fast_losses.val and fast_losses.val == plain_losses.val
    assert_same_params(params(fast), params(plain))


RESUME_AT = {  # 256 samples
    "mid-epoch": (20, []),  # batches of 16: the 5th batch of the 2nd epoch
    "end-of-epoch": (16, []),  # the last batch of the 1st: the resumed run starts in an epoch with no batch left
    "end-of-short-epoch": (11, ["data.batch_size=24", "data.drop_last=false"]),  # a last batch of 16 samples
}


@pytest.mark.parametrize("target, workers, fetch", [
    ("fixtures.tensor_blobs", 0, "fast"), ("fixtures.AugmentedBlobs", 0, "fast"),
    ("fixtures.AugmentedBlobs", 2, "fast"), ("fixtures.tensor_blobs", 0, "per-sample"),
])
@pytest.mark.parametrize("at", list(RESUME_AT))
def test_a_run_resumes_exactly_wherever_its_checkpoint_is_in_the_epoch(tmp_path, target, workers, fetch, at):
    step, extra = RESUME_AT[at]
    common = ["loop.max_steps=24", f"checkpoint.every_steps={step}", "checkpoint.keep_last=3",
              f"data.train._target_={target}",
              f"data.num_workers={workers}", f"data.batched_fetch={fetch == 'fast'}", *extra]
    straight, straight_losses = fit(tmp_path / "straight", *common)
    resumed, resumed_losses = fit(tmp_path / "resumed", *common,
                                  f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / f'step-{step:08d}'}")
    assert isinstance(resumed.train_loader.dataset, BatchReader) is (fetch == "fast")
    assert resumed_losses.train == straight_losses.train[step:]
    assert_same_params(params(straight), params(resumed))


def test_a_closed_pass_gives_no_more_batches():
    """A pass read in process (no workers) is closed as a pass with workers is (``FrameworkLoader.close``
    at the end of a run): nothing read ahead is handed out after it."""
    loader = make_loader(dataset(64), 4, batched_fetch=True, shuffle=True, seed=3, num_workers=0, drop_last=True)
    batches = epoch_batches(loader, 0)
    next(batches)  # reads a chunk ahead
    loader.close()
    assert list(batches) == []

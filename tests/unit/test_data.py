"""``csframework.data``: the loaders a run reads.

Any dataset: a custom ``collate_fn``, ``IterableDataset``s sharded across loader workers (each sample read
once per epoch, resumable), and the loader settings ``persistent_workers``, ``prefetch_factor``. Under DDP:
tests/e2e/test_datasets_ddp.py.

Nothing hangs forever and no loader worker outlives its run (issue 9, item 6): a worker stuck in
``__getitem__`` fails the run after ``data.timeout_s`` naming the loader, the worker and its pid, and whatever
ends a run leaves no worker behind (through the CLI, under signals: tests/e2e/test_loader_hangs.py).

Hostile datasets (issue 27, item 6), each one line naming the culprit: a ``__len__`` that is huge, negative
or not an int is a ``ConfigError`` naming the key and value; a ``collate_fn`` returning ``None`` or a
``__getbatch__`` returning the wrong rows (in process and in a loader worker) a ``DataError`` naming the key
and the function. (A plugin section of a reserved name: test_plugins.py; ``run.request_stop`` in a loader
worker: test_run.py.)"""
from __future__ import annotations

import json
import multiprocessing
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import csframework as csf
from csframework.config.sections import DataConfig
from csframework.data import MAX_DATASET_LEN, make_loader
from csframework.defaults.tiny import Clusters
from csframework.errors import ConfigError, DataError, DataTimeoutError, PluginError, ValidationError

import fixtures
from fixtures import compose, one_line
from numbered import N, write_conf
from stalling import BOUND_S, TIMEOUT_S, hung_pid, stalling, survivors, worker_pids

#: the hang tests find their workers in /proc
reads_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@pytest.fixture
def conf(tmp_path):
    return write_conf(tmp_path / "conf")


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


@pytest.mark.parametrize("step", [10, 8], ids=["mid-epoch", "end-of-epoch"])  # 8 batches an epoch
def test_an_iterable_dataset_resumes_from_the_middle_of_an_epoch_exactly(conf, tmp_path, step):
    common = ["data.num_workers=2", "loop.max_steps=12", f"checkpoint.every_steps={step}", "checkpoint.keep_last=3"]
    straight = run(conf, tmp_path, *common, name="straight")
    resumed = run(conf, tmp_path, *common, name="resumed",
                  *[f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / f'step-{step:08d}'}"])
    assert resumed.model.seen == straight.model.seen[step:]
    for (key, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key


def test_a_stateful_iterable_dataset_is_restored_from_its_state_dict(conf, tmp_path):
    common = ["data.train._target_=numbered.StatefulNumbered", "loop.max_steps=12", "checkpoint.every_steps=5",
              "checkpoint.keep_last=3"]
    straight = run(conf, tmp_path, *common, name="straight")
    resumed = run(conf, tmp_path, *common, name="resumed",
                  *[f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000005'}"])
    assert resumed.train_loader.dataset.dataset.loaded == [{"given": 40}]
    assert resumed.model.seen == straight.model.seen[5:]


class Epochs:
    """The epoch of every training step."""

    name = "epochs"

    def __init__(self):
        self.epochs = []

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.epochs.append(run.epoch)


def test_a_stateful_iterable_dataset_resumed_after_its_short_last_batch_goes_on_in_the_next_epoch(conf, tmp_path):
    # 64 samples in batches of 24: 24, 24, 16; the checkpoint of step 3 is written after the iterator ended
    common = ["model=seen", "data=numbered", "data.train._target_=numbered.StatefulNumbered", "data.batch_size=24",
              "data.drop_last=false", "loop.max_steps=8", "loop.eval_every=null", "optimizer=sgd",
              "checkpoint.every_steps=3", "checkpoint.keep_last=3"]
    runs = {}
    resume = f"checkpoint.resume={tmp_path}/straight/checkpoints/step-00000003"
    for name, extra in [("straight", []), ("resumed", [resume])]:
        epochs = Epochs()
        run = csf.Run(csf.compose([*common, *extra], config_dir=str(conf)), output_dir=tmp_path / name,
                      plugins=[epochs])
        run.fit()
        runs[name] = (run, epochs.epochs)
    (straight, straight_epochs), (resumed, resumed_epochs) = runs["straight"], runs["resumed"]
    assert straight_epochs == [0, 0, 0, 1, 1, 1, 2, 2]
    assert resumed_epochs == straight_epochs[3:], "the resumed run starts in the next epoch, not a new epoch 0"
    assert resumed.model.seen == straight.model.seen[3:]


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
    (["data.collate_fn._target_=builtins.nothing_here"],
     "data.collate_fn._target_: builtins.nothing_here: module 'builtins' has no 'nothing_here'"),
])
def test_iterable_dataset_errors_name_the_key(conf, tmp_path, overrides, message):
    with pytest.raises(csf.ConfigError, match=message):
        run(conf, tmp_path, *overrides)


# -- epochs too small for the run --------------------------------------------------------------------------
def blobs_run(tmp_path, *overrides):
    cfg = fixtures.compose("data.train._target_=fixtures.tensor_blobs", "data.val._target_=fixtures.tensor_blobs",
                           *overrides)
    return csf.Run(cfg, output_dir=tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["data.train.n=0"], r"^data.train: the dataset is empty \(TensorDataset has no sample\); check it$"),
    (["data.val.n=0"], r"^data.val: the dataset is empty .* or set data.val=null"),
    (["data.train.n=10", "data.drop_last=true"],
     r"^data.batch_size: 16 is larger than the training set \(10 samples, 10 per process\) with drop_last"),
    (["data.train.n=20", "data.drop_last=false", "loop.max_steps=null", "loop.max_epochs=1",
      "loop.grad_accum_steps=3"],
     r"^loop.grad_accum_steps: a step takes 3 batches, and 1 epoch\(s\) of 2 batch\(es\) make no step"),
])
def test_a_training_or_validation_set_too_small_for_the_run_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(csf.ConfigError, match=message):
        blobs_run(tmp_path, *overrides)


class StepRates:
    """The learning rate each optimizer step uses."""

    name = "step_rates"

    def __init__(self):
        self.rates = []

    @csf.hookimpl
    def on_before_optimizer_step(self, optimizer):
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_steps_of_an_accumulating_stage_span_epochs_so_the_schedule_has_their_number(tmp_path):
    # 48 samples in batches of 16: 3 batches an epoch; 2 a step over 4 epochs is 6 steps (a step spans
    # two epochs), and the linear schedule decays over those 6, not 4 (4 epochs x 1 whole step each)
    rates = StepRates()
    cfg = fixtures.compose("data.train._target_=fixtures.tensor_blobs", "data.train.n=48", "data.val=null",
                           "loop.max_steps=null", "loop.max_epochs=4", "loop.grad_accum_steps=2",
                           "optimizer.schedule.name=linear")
    run = csf.Run(cfg, output_dir=tmp_path, plugins=[rates])
    assert run.total_steps(run.stage_config) == 6
    assert run.fit()["global_step"] == 6
    # linear: from optimizer.lr down to min_lr (0) at the last step, every step a little lower
    assert len(rates.rates) == 6 and all(a > b for a, b in zip(rates.rates, rates.rates[1:]))
    assert rates.rates[0] == pytest.approx(0.1) and rates.rates[-1] == 0 and rates.rates[-2] > 0


# -- loader workers that hang -------------------------------------------------------------------------------

def fit_fails(run: csf.Run, error: type) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(error) as failed:
        run.fit()
    return failed.value, time.monotonic() - start


@reads_proc
@pytest.mark.parametrize("num_workers, hang_worker, after", [(1, 0, 0), (2, 1, 20)],
                         ids=["one-worker-first-batch", "second-of-two-workers-mid-epoch"])
@pytest.mark.slow
def test_a_hung_worker_fails_the_run_naming_it_and_no_worker_survives(tmp_path, num_workers, hang_worker, after):
    pids = tmp_path / "pids"
    run = csf.Run(compose(f"data.num_workers={num_workers}", f"data.timeout_s={TIMEOUT_S}",
                          *stalling(pids, hang_worker=hang_worker, after=after)), output_dir=tmp_path / "run")
    error, took = fit_fails(run, DataTimeoutError)
    message = str(error)
    assert f"data.train: loader worker {hang_worker} (pid {hung_pid(pids)})" in message
    assert "data.timeout_s" in message and f"in {TIMEOUT_S} s" in message and "Stalling" in message
    assert took < BOUND_S
    assert run.status == "failed" and error.exit_code == 1
    assert len(worker_pids(pids)) == num_workers and survivors(pids) == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


@reads_proc
@pytest.mark.slow
def test_a_hung_validation_worker_names_the_validation_loader_and_stops_the_training_workers(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    run = csf.Run(compose("data.num_workers=2", f"data.timeout_s={TIMEOUT_S}", "loop.max_steps=4",
                          *stalling(train), *stalling(val, "val", hang_worker=0)),
                  output_dir=tmp_path / "run")
    error, took = fit_fails(run, DataTimeoutError)
    assert f"data.val: loader worker 0 (pid {hung_pid(val)})" in str(error) and took < BOUND_S
    # the training pass stopped after 4 of its 8 batches, its workers still waiting for work: stopped too
    assert len(worker_pids(train)) == 2 and survivors(train) == []
    assert len(worker_pids(val)) == 2 and survivors(val) == []


@reads_proc
@pytest.mark.slow
def test_validate_mode_with_a_hung_worker_fails_and_leaves_no_worker(tmp_path):
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=1", f"data.timeout_s={TIMEOUT_S}",
                          *stalling(pids, "val", hang_worker=0)), output_dir=tmp_path / "run")
    with pytest.raises(DataTimeoutError, match=r"data\.val: loader worker 0 \(pid \d+\)"):
        run.validate()
    assert run.status == "failed" and survivors(pids) == []


class FailsOnceWorkerHangs:
    """Raises in the first step's last hook, once the ``Stalling`` worker of ``pid_dir`` hangs."""

    name = "fails_once_a_worker_hangs"

    def __init__(self, pid_dir: Path):
        self.pid_dir = pid_dir

    @csf.hookimpl
    def on_train_batch_end(self, run):
        deadline = time.monotonic() + 60
        while not list(self.pid_dir.glob("hung-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("boom")


@reads_proc
@pytest.mark.slow
def test_a_hook_error_while_a_worker_hangs_leaves_no_worker(tmp_path):
    """No timeout, worker 1 stuck in ``__getitem__``, and the run fails for another reason: torch's own
    shutdown gives up on a worker that does not stop (and SIGTERM does not reach it); the run kills it."""
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=2", "data.timeout_s=0", *stalling(pids, hang_worker=1)),
                  plugins=[FailsOnceWorkerHangs(pids)], output_dir=tmp_path / "run")
    with pytest.raises(PluginError, match="boom"):
        run.fit()
    assert run.status == "failed"
    assert len(worker_pids(pids)) == 2 and hung_pid(pids) in worker_pids(pids)
    assert survivors(pids) == []


@reads_proc
@pytest.mark.slow
def test_a_completed_run_that_stops_mid_epoch_leaves_no_worker(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    run = csf.Run(compose("data.num_workers=2", "loop.max_steps=5", "loop.eval_every=2", "loop.eval_steps=1",
                          *stalling(train), *stalling(val, "val")), output_dir=tmp_path / "run")
    assert run.fit()["status"] == "completed"
    assert worker_pids(train) and worker_pids(val)
    assert survivors(train) == [] and survivors(val) == []


@reads_proc
@pytest.mark.slow
def test_a_slow_worker_within_the_timeout_per_batch_does_not_trip_it(tmp_path):
    """The timeout bounds the wait for one batch, not a pass: 8 batches of 16 samples x 30 ms take at least
    3.8 s in all, more than the 3 s timeout, but under 0.5 s each."""
    pids = tmp_path / "pids"
    run = csf.Run(compose("data.num_workers=1", "data.timeout_s=3", "loop.max_steps=8",
                          *stalling(pids, delay=0.03)), output_dir=tmp_path / "run")
    assert run.fit()["status"] == "completed"
    assert survivors(pids) == []


@reads_proc
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_a_config_error(value):
    with pytest.raises(ValidationError, match=r"data\.timeout_s: .* must be (a finite number )?between 0 and \d+ seconds"):
        csf.Run(compose("data.num_workers=1", f"data.timeout_s={value}"))


@reads_proc
def test_the_timeout_reaches_the_loader_only_with_workers():
    with_workers = csf.Run(compose("data.num_workers=1", "data.timeout_s=7"))
    assert with_workers.train_loader.timeout == 7 and with_workers.val_loader.timeout == 7
    assert csf.Run(compose("data.num_workers=0", "data.timeout_s=7")).train_loader.timeout == 0
    assert DataConfig().timeout_s == 600


# -- dataset lengths (issue 27, item 6) ---------------------------------------------------------------------
class Sized(Clusters):
    """``Clusters`` whose ``__len__`` returns ``length`` as it is."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def __len__(self):
        return self.length


def beyond_maxsize(**kwargs):
    return Sized(sys.maxsize + 1, **kwargs)


def beyond_limit(**kwargs):
    return Sized(MAX_DATASET_LEN + 1, **kwargs)


def negative(**kwargs):
    return Sized(-3, **kwargs)


def fractional(**kwargs):
    return Sized(3.5, **kwargs)


def textual(**kwargs):
    return Sized("128", **kwargs)


@pytest.mark.parametrize("key", ["data.train", "data.val"])
@pytest.mark.parametrize("factory, value, why", [
    (beyond_maxsize, str(sys.maxsize + 1), f"more than the {MAX_DATASET_LEN} samples (2**40) a sampler can index"),
    (beyond_limit, str(MAX_DATASET_LEN + 1), f"more than the {MAX_DATASET_LEN} samples"),
    (negative, "-3", "which is no number of samples; it must return an int from 0 up"),
    (fractional, "3.5", "which is no number of samples"),
    (textual, "'128'", "which is no number of samples"),
], ids=["beyond-maxsize", "beyond-limit", "negative", "float", "str"])
def test_a_dataset_length_that_is_no_sample_count_is_refused_naming_the_key_and_value(runner, key, factory, value,
                                                                                    why):
    result = runner.run([f"{key}._target_={__name__}.{factory.__name__}"])
    assert result.exit_code == 2 and isinstance(result.error, ConfigError), result.error
    assert one_line(result.error).startswith(f"{key}: Sized.__len__ returned {value}, {why}"), result.error


def test_a_dataset_at_the_length_limit_is_sampled_as_usual():
    loader = make_loader(Sized(MAX_DATASET_LEN), 4, shuffle=False, seed=0, num_workers=0, drop_last=True)
    assert len(loader) == MAX_DATASET_LEN // 4  # the order is made only when a pass starts


# -- collate_fn and __getbatch__ results (issue 27, item 6) -------------------------------------------------
def collate_none(samples):
    return None


class ShortLabels(Clusters):
    """A ``__getbatch__`` whose points are right and whose labels miss the last row: the model would train
    on misaligned rows or fail far away."""

    def __getbatch__(self, indices):
        points, labels = super().__getbatch__(indices)
        return [points, labels[:-1]]


class KeyedNumpy(Clusters):
    def __getbatch__(self, indices):
        points, labels = super().__getbatch__(indices)
        return {"x": points, "y": labels.numpy()}


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("overrides, message", [
    ([f"+data.collate_fn._target_={__name__}.collate_none"],
     f"data.train: data.collate_fn ({__name__}.collate_none) returned None for 16 samples; it must return the batch"),
    ([f"data.train._target_={__name__}.ShortLabels"],
     "data.train: ShortLabels.__getbatch__ returned 15 rows for 16 indices; it must return one row per index, in "
     "their order (batch[1])"),
    ([f"data.val._target_={__name__}.ShortLabels"],
     "data.val: ShortLabels.__getbatch__ returned 15 rows for 16 indices"),
    ([f"data.train._target_={__name__}.KeyedNumpy"],
     "data.train: KeyedNumpy.__getbatch__ returned NumPy arrays (batch['y'])"),
], ids=["collate-none", "getbatch-short-second-tensor", "val-getbatch", "getbatch-numpy-in-a-dict"])
def test_a_batch_that_is_no_batch_is_named_with_its_key_and_function(runner, overrides, message, workers):
    result = runner.run([*overrides, f"data.num_workers={workers}"])
    assert result.exit_code == 1 and isinstance(result.error, DataError), result.error
    assert one_line(result.error).startswith(message), result.error


def test_a_collate_fn_is_used_as_before():
    from torch.utils.data import default_collate

    loader = make_loader(Clusters(n=8), 4, shuffle=False, seed=0, num_workers=0, drop_last=True,
                         collate_fn=default_collate)
    batches = list(loader)
    assert len(batches) == 2 and torch.equal(batches[0][0], Clusters(n=8).points[:4])


# -- the command line: one line, no traceback (issue 27, item 6) --------------------------------------------
@pytest.mark.slow
def test_the_command_line_prints_each_as_one_line_without_a_traceback(tmp_path, runner):
    (tmp_path / "dotted_section.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import csframework as csf

        @dataclass
        class Section:
            value: int = 0

        @csf.hookimpl
        def csframework_config_sections():
            return {"a.b": Section}
    '''))
    env = {"PYTHONPATH": fixtures.pythonpath(str(tmp_path))}
    cases = [
        (["plugins.enable=[dotted_section]"], 2, "plugin 'dotted_section' declares config section 'a.b'"),
        ([f"data.train._target_={__name__}.negative"], 2, "data.train: Sized.__len__ returned -3"),
        ([f"+data.collate_fn._target_={__name__}.collate_none", "data.num_workers=1"], 1,
         f"data.train: data.collate_fn ({__name__}.collate_none) returned None"),
        ([f"data.train._target_={__name__}.ShortLabels", "data.num_workers=1"], 1,
         "data.train: ShortLabels.__getbatch__ returned 15 rows for 16 indices"),
    ]
    for overrides, code, message in cases:
        result = runner.cli(overrides, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == code, result.stderr[-2000:]
        assert lines[-1].startswith(f"csframework: error: {message}"), result.stderr[-2000:]
        assert "Traceback" not in result.stderr


# -- issue 42: one function builds a loader, for the run and for the Cerebras input workers ----------------
CLUSTERS = {"_target_": "csframework.defaults.tiny.Clusters", "n": 64}


def test_a_loader_gets_every_data_setting_from_the_one_function_that_builds_it():
    from csframework.data import build_loader

    data = DataConfig(train=CLUSTERS, val=CLUSTERS, batch_size=8, eval_batch_size=16, num_workers=2, timeout_s=7.0,
                      prefetch_factor=3, pin_memory=True, persistent_workers=True, drop_last=False)
    train, dataset = build_loader(data, "train", seed=1)
    assert (train.num_workers, train.timeout, train.prefetch_factor, train.pin_memory) == (2, 7.0, 3, True)
    assert train.persistent_workers and len(dataset) == 64 and train.samples_per_batch == 8
    val, _ = build_loader(data, "val", seed=1, eval_steps=1)
    assert val.samples_per_batch == 16 and val.position.sample == 16 and not val.position.shuffle
    assert build_loader(DataConfig(train=CLUSTERS), "train", seed=1, device_type="GPU")[0].pin_memory  # null: GPU
    with pytest.raises(ConfigError, match=r"data.eval.holdout: no such evaluation set \(sets: val\)"):
        build_loader(data, "holdout", seed=1)


def test_the_cerebras_input_workers_read_the_batches_the_run_reads():
    pytest.importorskip("csframework_cerebras")
    from omegaconf import OmegaConf

    from csframework.data import build_loader, epoch_batches
    from csframework_cerebras.data import input_fn, val_input_fn

    data = DataConfig(train=CLUSTERS, val=CLUSTERS, batch_size=8, timeout_s=9.0, prefetch_factor=None)
    plain = OmegaConf.to_container(OmegaConf.structured(data), resolve=True, enum_to_str=True)
    ours, _ = build_loader(data, "train", seed=3)
    expected = [b for e in (2, 3) for b in epoch_batches(ours, e, 5 if e == 2 else 0)]
    batches = input_fn(plain, 3, epoch=2, start=5)
    for want in expected:  # from batch 5 of epoch 2 on, through the next epoch
        got = next(batches)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    val = val_input_fn(plain, 3)
    assert (val.timeout, val.samples_per_batch) == (0, 8)  # no workers: no timeout applies, as in the run
    assert [len(b[0]) for b in val] == [len(b[0]) for b in build_loader(data, "val", seed=3)[0]]

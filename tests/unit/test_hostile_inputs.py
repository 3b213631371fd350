"""Hostile inputs that gave a traceback or misbehaved silently (issue 27, item 6), each now one line naming
the culprit, exit 1 or 2:

- a plugin config section with a reserved or invalid name (``a.b``, ``_target_``, ``hydra`` ...) or a
  dataclass whose default its declared type cannot hold: ``ConfigError`` naming plugin, section, field;
- a dataset whose ``__len__`` is huge, negative or not an int: ``ConfigError`` naming the key and value;
- a ``collate_fn`` returning ``None``, a ``__getbatch__`` returning the wrong rows (in process and in a
  loader worker): ``DataError`` naming the key and the function;
- ``run.request_stop`` called in a loader worker (where the run never saw it): ``WrongProcessError``.
"""
from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass, field
from typing import List

import pytest
import torch
from torch.utils.data import Dataset

import csframework as csf
import fixtures
from csframework.data import MAX_DATASET_LEN, make_loader
from csframework.defaults.tiny import Clusters
from csframework.errors import ConfigError, DataError, WrongProcessError
from csframework.testing import TINY_RUN, CsfRunner


@pytest.fixture
def runner(tmp_path):
    return CsfRunner(tmp_path)


def one_line(error: BaseException) -> str:
    """The error's message, checked to be one line (what the CLI prints after ``csframework: error:``)."""
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# -- 1. plugin config sections ---------------------------------------------------------------------------
@dataclass
class Plain:
    value: int = 0


def section_plugin(section, schema=Plain):
    """A plugin object named ``sections`` declaring config section ``section`` as ``schema``."""
    class Sections:
        name = "sections"

        @csf.hookimpl
        def csframework_config_sections(self):
            return {section: schema}

    return Sections()


@pytest.mark.parametrize("section", ["a.b", "_target_", "_self_", "hydra", "defaults", "1st", "class", "selected",
                                     "a b", "ünï", "line\nbreak", "", 3])
def test_a_section_with_a_reserved_or_invalid_name_is_refused_naming_plugin_and_section(tmp_path, section):
    with pytest.raises(ConfigError) as caught:
        csf.Run([*TINY_RUN], plugins=[section_plugin(section)], output_dir=tmp_path / "run")
    message = one_line(caught.value)
    assert caught.value.exit_code == 2
    assert message.startswith(f"plugin 'sections' declares config section {section!r}, which "), message
    assert message.endswith("the plugin must name its section differently")
    assert not (tmp_path / "run").exists(), "nothing was written"


def test_a_valid_section_name_still_composes(tmp_path):
    run = csf.Run([*TINY_RUN, "my_section2.value=4"], plugins=[section_plugin("my_section2")], output_dir=tmp_path)
    assert run.config.my_section2.value == 4


@dataclass
class WrongDefault:
    count: int = "three"  # type: ignore[assignment]


@dataclass
class NoneForInt:
    count: int = None  # type: ignore[assignment]


@dataclass
class SetField:
    tags: set = field(default_factory=set)


@dataclass
class ListFromInt:
    names: List[str] = 3  # type: ignore[assignment]


@dataclass
class Inner:
    rate: float = "fast"  # type: ignore[assignment]


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)


@dataclass(frozen=True)
class Frozen:
    value: int = 0


@dataclass(slots=True)
class Slotted:
    value: int = 0


@pytest.mark.parametrize("schema, detail", [
    (WrongDefault, "as WrongDefault, whose field 'count' has a default its declared type cannot hold (Value 'three' "
                   "of type 'str' could not be converted to Integer)"),
    (NoneForInt, "as NoneForInt, whose field 'count' has a default its declared type cannot hold (Incompatible "
                 "value 'None' for field of type 'int')"),
    (SetField, "as SetField, whose field 'tags' has a default its declared type cannot hold (Unexpected type "
               "annotation: set)"),
    (ListFromInt, "as ListFromInt, whose field 'names' has a default its declared type cannot hold"),
    (Outer, "as Outer, whose field 'rate' of Inner has a default its declared type cannot hold"),
    (Frozen, "as Frozen, a frozen or slots dataclass; declare a plain @dataclass"),
    (Slotted, "as Slotted, a frozen or slots dataclass; declare a plain @dataclass"),
], ids=["str-for-int", "none-for-int", "set", "int-for-list", "nested", "frozen", "slots"])
def test_a_section_whose_defaults_its_types_cannot_hold_is_refused_naming_plugin_section_and_field(
        tmp_path, schema, detail):
    with pytest.raises(ConfigError) as caught:
        csf.Run([*TINY_RUN], plugins=[section_plugin("mine", schema)], output_dir=tmp_path)
    message = one_line(caught.value)
    assert caught.value.exit_code == 2
    assert message.startswith(f"mine: plugin 'sections' declares config section 'mine' {detail}"), message


# -- 2. dataset lengths ----------------------------------------------------------------------------------
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


# -- 3. collate_fn and __getbatch__ results --------------------------------------------------------------
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


# -- 4. request_stop from a loader worker ------------------------------------------------------------------
class Stopping(Dataset):
    """A dataset that asks its run to stop when it reads a sample (``HandsRun`` gives it the run)."""

    run = None

    def __init__(self, **kwargs):
        self.data = Clusters(**kwargs)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if Stopping.run is not None:
            Stopping.run.request_stop("enough data")
        return self.data[i]


class HandsRun:
    name = "hands_run"

    @csf.hookimpl
    def on_fit_start(self, run):
        Stopping.run = run


@pytest.fixture
def stopping():
    yield [f"data.train._target_={__name__}.Stopping"]
    Stopping.run = None


def test_request_stop_in_a_loader_worker_is_refused_naming_it(runner, stopping):
    result = runner.run([*stopping, "data.num_workers=1"], plugins=[HandsRun()])
    assert result.exit_code == 1 and isinstance(result.error, WrongProcessError), result.error
    message = one_line(result.error)
    assert message.startswith("run.request_stop('enough data') was called in process ")
    assert "(a data-loader worker or another child process), where the run would never see it" in message
    assert result.summary.get("status") == "failed" and "stop_reason" not in result.summary


def test_request_stop_in_the_runs_process_still_stops_it(runner, stopping):
    result = runner.run([*stopping, "data.num_workers=0"], plugins=[HandsRun()])
    assert result.exit_code == 0, result.error
    assert result.summary["stop_reason"] == "enough data" and result.summary["global_step"] == 1


# -- the command line: one line, no traceback --------------------------------------------------------------
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

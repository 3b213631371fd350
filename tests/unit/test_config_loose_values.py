"""``csframework.config.loose_values``: values OmegaConf would take for a field but should not (issue 47 items 11
and 12): a number for any boolean of any section (OmegaConf made ``checkpoint.start_over=2`` and ``-1`` true),
and a mapping or list as an element of a list of plain values (``optimizer.weight_decay_exclude=[{a:1}]`` was a
``ConfigKeyError`` traceback, ``+optimizer.groups.h.params=[{a:1}]`` a ``TypeError``). Each is one line naming
the key and the element's index, before anything is built."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

import pytest

import csframework as csf
from csframework.backends.csx.schema import CsxConfig
from csframework.backends.eager import CpuConfig, GpuConfig
from csframework.builtin import validation
from csframework.config import RunConfig
from csframework.config.loose_values import loose_values
from csframework.errors import ConfigError
from fixtures import CONF, TINY


def compose_error(*overrides: str, plugins=()) -> str:
    with pytest.raises(ConfigError) as caught:
        csf.compose([*TINY, *overrides], config_dir=CONF, plugins=plugins)
    return str(caught.value)


def fields_of_kind(schema: type, wanted, prefix: str = "") -> list[str]:
    """The dotted keys of ``schema``'s fields (nested sections too) whose type ``wanted(type)`` accepts."""
    found = []
    for name, kind in typing.get_type_hints(schema).items():
        if name not in {f.name for f in dataclasses.fields(schema)}:
            continue
        inner = next((a for a in typing.get_args(kind) if a is not type(None)), kind) \
            if typing.get_origin(kind) is typing.Union else kind
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            found += fields_of_kind(inner, wanted, f"{prefix}{name}.")
        elif wanted(inner):
            found.append(prefix + name)
    return found


def is_bool(kind) -> bool:
    return kind is bool


def is_plain_list(kind) -> bool:
    return typing.get_origin(kind) is list and typing.get_args(kind)[0] in (str, int, float)


RUN_BOOLEANS = [k for k in fields_of_kind(RunConfig, is_bool) if k not in ("debug",)]
BACKENDS = {"cpu": CpuConfig, "gpu": GpuConfig, "csx": CsxConfig}


def test_this_file_sees_the_booleans_and_lists_it_means_to():
    assert {"checkpoint.start_over", "data.shuffle", "loop.inference_mode"} <= set(RUN_BOOLEANS)
    assert "compile_whole_step" in fields_of_kind(CpuConfig, is_bool)  # an Optional[bool]
    assert {"optimizer.weight_decay_exclude", "loop.collect", "plugins.enable"} <= set(
        fields_of_kind(RunConfig, is_plain_list))


@pytest.mark.parametrize("number", ["2", "-1"])
def test_a_number_for_any_boolean_of_the_run_is_refused_naming_each_key(number):
    message = compose_error(*(f"{key}={number}" for key in RUN_BOOLEANS))
    for key in RUN_BOOLEANS:
        assert f"{key}: {number} is a number, and it takes true or false" in message, key


@pytest.mark.parametrize("device", sorted(BACKENDS))
def test_a_number_for_any_boolean_of_each_backend_is_refused_naming_each_key(device):
    keys = fields_of_kind(BACKENDS[device], is_bool)
    message = compose_error(f"device={device}", *(f"backend.{key}=2" for key in keys))
    for key in keys:
        assert f"backend.{key}: 2 is a number, and it takes true or false" in message, key


def test_a_number_for_a_boolean_of_a_stage_is_refused_naming_the_stage():
    config = csf.compose([*TINY, "+stages.a.checkpoint.start_over=2", "+stages.a.backend.compile=-1"],
                         config_dir=CONF)
    [message] = validation.csframework_validate(config=config)  # a stage that does not merge: one problem
    assert "stages.a.checkpoint.start_over: 2 is a number, and it takes true or false" in message
    assert "stages.a.backend.compile: -1 is a number, and it takes true or false" in message


def test_booleans_and_their_words_still_compose():
    config = csf.compose([*TINY, "checkpoint.start_over=true", "data.shuffle=false", "backend.compile_whole_step=null"],
                         config_dir=CONF)
    assert config.checkpoint.start_over is True and config.data.shuffle is False


@pytest.mark.parametrize("element, described", [("{a:1}", "{'a': 1} is a mapping"), ("[1]", "[1] is a list")])
def test_a_container_in_any_list_of_plain_values_is_refused_naming_the_key_and_index(element, described):
    keys = fields_of_kind(RunConfig, is_plain_list)
    message = compose_error(*(f"{key}=[0.5,{element}]" for key in keys))
    for key in keys:
        assert f"{key}[1]: {described}, and {key} holds " in message, key


def test_a_container_in_a_backends_list_is_refused():
    assert "backend.fsdp_wrap[0]: {'a': 1} is a mapping, and backend.fsdp_wrap holds strings" in compose_error(
        "device=gpu", "backend.fsdp_wrap=[{a:1}]")


def test_a_container_among_a_groups_patterns_is_one_problem_naming_the_key():
    config = csf.compose([*TINY, "+optimizer.groups.h.params=[{a:1}]"], config_dir=CONF)
    assert validation.csframework_validate(config=config) == [
        "optimizer.groups.h.params[0]: {'a': 1} is a mapping, and optimizer.groups.h.params holds strings; "
        "write each element as a plain value"]


# -- a plugin's section ---------------------------------------------------------------------------------------
@dataclass
class Mine:
    flag: bool = False
    maybe: Optional[bool] = None
    names: List[str] = field(default_factory=list)
    anything: Any = None


class MinePlugin:
    name = "mine_plugin"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"mine": Mine}


def test_a_plugins_section_is_checked_alike():
    message = compose_error("mine.flag=2", "mine.maybe=-1", "mine.names=[{a:1}]", plugins=[MinePlugin()])
    assert "mine.flag: 2 is a number" in message and "mine.maybe: -1 is a number" in message
    assert "mine.names[0]: {'a': 1} is a mapping, and mine.names holds strings" in message
    config = csf.compose([*TINY, "mine.flag=true", "mine.names=[a,b]", "mine.anything={a:1}"], config_dir=CONF,
                         plugins=[MinePlugin()])
    assert config.mine.flag is True and config.mine.names == ["a", "b"]


# -- the rule itself ------------------------------------------------------------------------------------------
def test_a_hostile_element_is_shown_bounded():
    [problem] = loose_values({"names": [{"k" * 5000: 1}]}, Mine)
    assert problem.startswith("names[0]: {") and len(problem) < 200


def test_interpolations_and_absent_keys_are_left_to_omegaconf():
    assert loose_values({"flag": "${other}", "names": ["${x}"]}, Mine) == []
    assert loose_values({}, Mine) == [] and loose_values("not a mapping", Mine) == []

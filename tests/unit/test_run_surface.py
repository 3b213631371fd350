"""``Run`` as one surface (issue 51 item 5): a plugin reads each piece of the run under one name, ``run.<name>``
(``protocol.RunProtocol`` lists them), never through the loop's record ``run.state``, which the loop writes
and csframework's loop, step and backends read (``protocol.LoopRun``)."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import csframework as csf
from csframework.protocol import LoopRun, RunProtocol
from csframework.stage import Stage
from csframework.state import RunState
from import_graph import PACKAGE

import fixtures
from fixtures import fit

ROOT = PACKAGE.parent
#: Where plugins live: the built-in ones, the first-party packages and the examples' own.
PLUGIN_CODE = [PACKAGE / "builtin", ROOT / "plugins", ROOT / "examples"]
#: Modules there that are not plugins but the run's own machinery, and why they read the loop's record.
NOT_PLUGINS = {
    "csframework/builtin/checkpoint/schema.py": "Run.state_dict/load_state_dict's layout: loading a checkpoint "
                                                "writes the loop's position (typed against LoopRun)",
}


# -- no plugin touches run.state --------------------------------------------------------------------------
def _is_a_run(node: ast.expr) -> bool:
    """``run`` or ``<x>.run`` (every hook receives the run as ``run``: pluggy passes arguments by name)."""
    return (isinstance(node, ast.Name) and node.id == "run") or (isinstance(node, ast.Attribute) and node.attr == "run")


def record_uses(source: str) -> list[str]:
    """Where ``source`` reads or writes the loop's record through a run: ``run.state``, ``self.run.state``,
    ``getattr(run, "state")``, as ``line N``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "state" and _is_a_run(node.value):
            found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and _is_a_run(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "state"):
            found.append(node.lineno)
    return [f"line {line}" for line in sorted(found)]


def test_no_plugin_reads_or_writes_the_loops_record():
    files = [p for where in PLUGIN_CODE for p in where.rglob("*.py")
             if str(p.relative_to(ROOT)) not in NOT_PLUGINS and ".venv" not in p.parts]
    assert len(files) > 40  # the built-ins, the plugin packages and the examples were all found
    uses = {str(p.relative_to(ROOT)): record_uses(p.read_text()) for p in files}
    assert {path: lines for path, lines in uses.items() if lines} == {}, \
        "read run.<name> (protocol.RunProtocol), not run.state; say when you save with run.set_save_due"


def test_a_plugin_touching_the_record_is_found():
    assert record_uses("def on_train_start(self, run):\n    run.state.save_due = self.due\n") == ["line 2"]
    assert record_uses("x = self.run.state.last_eval_step\ny = getattr(run, 'state')\n") == ["line 1", "line 2"]
    assert record_uses("x = run.last_eval_step\ny = optimizer.state[p]\nz = self.state\n") == []


# -- RunProtocol names each piece once --------------------------------------------------------------------
#: The holders of mirrored pieces, by the type name a member would be annotated with: their fields.
HOLDERS = {"RunState": {f.name for f in dataclasses.fields(RunState)},
           "Stage": {f.name for f in dataclasses.fields(Stage)} | {"val_loader"}}


def members(protocol: type) -> dict[str, str]:
    """The data members of ``protocol`` and its bases (attributes and properties): name -> declared type."""
    found: dict[str, str] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ != "csframework.protocol":
            continue
        found.update(cls.__dict__.get("__annotations__", {}))
        found.update({name: value.fget.__annotations__["return"] for name, value in vars(cls).items()
                      if isinstance(value, property)})
    return found


def second_spellings(protocol: type) -> list[str]:
    """``holder.x`` for each piece of ``protocol`` it reaches both as ``run.x`` and through a member holding it."""
    declared = members(protocol)
    return [f"{name}.{field}" for name, kind in declared.items() for field in sorted(HOLDERS.get(kind, ()))
            if field in declared]


def test_run_protocol_names_each_piece_of_state_once():
    assert "state" not in members(RunProtocol) and "current" not in members(RunProtocol)
    assert second_spellings(RunProtocol) == []


def test_a_second_spelling_is_found():
    # LoopRun, the machinery's view, holds the record itself: global_step is also state.global_step there
    assert {"state.global_step", "state.metrics", "state.stop_reason"} <= set(second_spellings(LoopRun))


def test_every_documented_field_of_the_record_is_a_run_attribute():
    """The fields the API reference documents for ``RunState`` are what plugins read as ``run.<field>``."""
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = re.search(r"::: csframework\.state\.RunState\n\s+options:\n\s+members: \[([^\]]*)\]", api)
    assert listed
    documented = {name.strip() for name in listed.group(1).split(",")}
    assert documented - set(members(RunProtocol)) == set()
    assert documented <= {f.name for f in dataclasses.fields(RunState)}


# -- Run's mirrors ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return csf.Run(fixtures.compose(), output_dir=tmp_path_factory.mktemp("surface"))


def test_the_mirrors_read_the_record_and_the_stage(run):
    run.state.global_step, run.state.last_eval_step = 7, 5
    assert (run.global_step, run.last_eval_step, run.metrics) == (7, 5, run.state.metrics)
    assert run.module is run.current.module and run.param_groups is run.current.param_groups
    assert type(run).global_step.__doc__ == "``RunState.global_step`` (read-only; documented there)."


@pytest.mark.parametrize("name", ["global_step", "stopping", "module"])
def test_a_mirror_is_read_only_and_says_whose_it_is(run, name):
    with pytest.raises(AttributeError, match=rf"run\.{name} is read-only: it is (RunState|Stage)\.{name}"):
        setattr(run, name, 1)


# -- the public way to say when a plugin saves --------------------------------------------------------------
class Saver:
    """Saves (pretends to) at step 3 through ``run.set_save_due``; records when metrics reach it."""

    name = "saver"

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    @csf.hookimpl
    def on_train_start(self, run):
        run.set_save_due(lambda step: step == 3)

    @csf.hookimpl
    def on_log_metrics(self, run, metrics, step):
        if "train/loss" in metrics:
            self.seen.append(("logged", step))

    @csf.hookimpl
    def on_train_step_end(self, run, step):
        self.seen.append(("step_end", step))


def test_a_plugin_saving_at_a_step_gets_its_metrics_reported_before_the_steps_hooks(tmp_path):
    saver = Saver()
    fit(tmp_path, "loop.max_steps=4", "loop.log_every=10", "plugins.disable=[checkpoint]", plugins=[saver])
    assert saver.seen == [("step_end", 1), ("step_end", 2), ("logged", 3), ("step_end", 3), ("logged", 4),
                          ("step_end", 4)]


class SaverWithCallback:
    """Says when it saves and hands the loop its save (``run.set_save_due(due, save)``): no hook of its own at
    every step."""

    name = "saver_with_callback"

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    @csf.hookimpl
    def on_train_start(self, run):
        run.set_save_due(lambda step: step % 2 == 0, lambda: self.seen.append(("saved", run.global_step)))

    @csf.hookimpl
    def on_log_metrics(self, run, metrics, step):
        if "train/loss" in metrics:
            self.seen.append(("logged", step))


class StepEnd:
    name = "step_end"

    def __init__(self, seen: list):
        self.seen = seen

    @csf.hookimpl
    def on_train_step_end(self, step):
        self.seen.append(("step_end", step))


def test_the_loop_calls_a_plugins_save_after_the_steps_hooks_at_the_steps_it_said(tmp_path):
    saver = SaverWithCallback()
    fit(tmp_path, "loop.max_steps=4", "loop.log_every=10", "plugins.disable=[checkpoint]",
        plugins=[saver, StepEnd(saver.seen)])
    assert saver.seen == [("step_end", 1), ("logged", 2), ("step_end", 2), ("saved", 2), ("step_end", 3),
                          ("logged", 4), ("step_end", 4), ("saved", 4)]


def test_the_checkpoint_plugin_has_no_hook_at_every_step(tmp_path):
    """It saves through ``set_save_due``'s ``save``: a run without a progress bar calls no ``on_train_step_end``."""
    from csframework.builtin.checkpoint.plugin import CheckpointPlugin

    assert not hasattr(CheckpointPlugin, "on_train_step_end")
    run = csf.Run(fixtures.compose("loop.max_steps=2"), output_dir=tmp_path)
    assert "on_train_step_end" in run.hooks.quiet()[1]

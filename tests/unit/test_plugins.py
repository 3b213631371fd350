"""``csframework.plugins``: the plugin manager, and plugins that misbehave (the hooks' dispatch: test_hooks.py).

The caller hands the manager the built-ins; pluggy loads entry points and blocks disabled plugins (a disabled
plugin is never imported); errors name the plugin.

Named backends (``csframework_named_backends``): ``backend=<name>`` picks a second backend of a device
type, beside the type's own backend (as ``backend=cerebras`` runs CSX beside the emulator).

Plugins that misbehave (issue 9 item 5): each gets the documented outcome and exit status.

- a hook implementation that matches no hook (a misspelled name, an argument the hook lacks) is refused at
  registration: ``ConfigError`` (exit 2) naming the plugin and the hook, nothing built or written;
- ``sys.exit()`` / ``SystemExit`` in a hook fails the run (exit 1) naming the plugin and the hook;
- a ``csframework_validate`` result that is neither ``None`` nor a list of strings fails naming the plugin;
- ``on_checkpoint_save`` state that JSON cannot hold fails the run naming the plugin and the key, before
  anything is written: the previous checkpoints stay complete and indexed, ``summary.json`` the true step;
- changing ``run.config`` while the run runs fails the run naming the plugin, the hook and the key;
- a plugin failing in ``on_exception`` masks neither the original error nor the other plugins' clean-up.

In-process cases use ``csf.Run``; the exit statuses are checked through the CLI with the plugin as a module
file on ``PYTHONPATH`` (``plugins.enable=[module]``).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest

import csframework as csf
import fixtures
from csframework.backends.csx.plugin import CsxPlugin
from csframework.backends.eager import EagerPlugin
from csframework.builtin.checkpoint import list_checkpoints, read_checkpoint
from csframework.errors import ConfigError, PluginError
from csframework.plugins import Hooks, backend_specs, build_manager
from csframework.testing import TINY_RUN
from fixtures import one_line
from forkrun import run_chains

from twin_backend import plugin as twin


def install(site, name, module_text):
    (site / f"{name}_plugin.py").write_text(module_text)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[csframework.plugins]\n{name} = {name}_plugin\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_only_the_given_builtins_are_registered():
    pm = build_manager([("eager", EagerPlugin())])
    assert [name for name, _ in pm.list_name_plugin()] == ["eager"]


def test_an_entry_point_that_fails_to_import_is_named_unless_disabled(site, monkeypatch):
    install(site, "broken", "raise ImportError('missing dependency foo')\n")
    monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", "broken")
    with pytest.raises(PluginError, match=r"plugin 'broken' \(distribution broken 0.1\) failed to load: ImportError: "
                                          r"missing dependency foo; turn it off with plugins.disable=\[broken\]"):
        build_manager([])
    pm = build_manager([], disable=["broken"])  # blocked: never imported
    assert pm.is_blocked("broken") and not pm.has_plugin("broken")


def test_disabling_an_unknown_plugin_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"plugins.disable: no plugin named nope \(known: csx, eager\)"):
        build_manager([("eager", EagerPlugin()), ("csx", CsxPlugin())], disable=["nope"])


def test_backends_come_from_the_backend_hooks():
    hooks = Hooks(build_manager([("eager", EagerPlugin()), ("csx", CsxPlugin())]))
    assert {t: spec.schema.__name__ for t, spec in backend_specs(hooks).items()} == {
        "CPU": "CpuConfig", "CSX": "CsxConfig", "GPU": "GpuConfig"}
    assert hooks.csframework_backend(device_type="TPU") is None
    assert Hooks(build_manager([])).csframework_backend(device_type="CPU") is None  # firstresult: None


def test_a_user_plugin_may_replace_a_builtin_backend():
    class MyCsx:
        name = "my_csx"

        @csf.hookimpl
        def csframework_backend(self, device_type):
            return "mine" if device_type == "CSX" else None

    hooks = Hooks(build_manager([("eager", EagerPlugin()), ("csx", CsxPlugin())], extra=[MyCsx()]))
    assert hooks.csframework_backend(device_type="CSX") == "mine"


# -- named backends -----------------------------------------------------------------------------------------

FAST = ["model=tiny_linear", "data=tiny_clusters", "loop.max_steps=3"]


def test_backend_by_name_runs_its_device_type_with_its_own_type_setting(tmp_path):
    cfg = csf.compose(["backend=twin", "backend.type=b", *FAST], plugins=[twin])
    assert cfg.device.type == "CPU"
    assert isinstance(cfg.backend, twin.TwinConfig) and cfg.backend.type == "B"
    summary = csf.Run(cfg, plugins=[twin], output_dir=tmp_path).fit()
    assert summary["status"] == "completed" and summary["twin"] == "B" and summary["device_type"] == "CPU"


def test_the_device_type_keeps_its_own_backend(tmp_path):
    cfg = csf.compose(["device=cpu", *FAST], plugins=[twin])
    assert not isinstance(cfg.backend, twin.TwinConfig)
    assert "twin" not in csf.Run(cfg, plugins=[twin], output_dir=tmp_path).fit()


def test_device_and_a_named_backend_are_exclusive():
    with pytest.raises(ConfigError, match=r"device, backend: both choose the device \(device=cpu, backend=twin\)"):
        csf.Run(csf.compose(["device=cpu", "backend=twin", *FAST], plugins=[twin]), plugins=[twin])


def test_its_settings_are_typed_and_named():
    with pytest.raises(ConfigError, match="backend.lr_scale"):
        csf.compose(["backend=twin", "backend.lr_scale=fast", *FAST], plugins=[twin])
    with pytest.raises(ConfigError, match=r"backend.lr_scale: only twin understands it.*use backend=twin"):
        csf.compose(["device=cpu", "+backend.lr_scale=2", *FAST], plugins=[twin])


def test_an_unknown_name_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"backend.name: 'nope' is not an installed backend; installed: twin"):
        csf.compose(["backend=twin", "backend.name=nope", *FAST], plugins=[twin])


# -- plugins that misbehave ---------------------------------------------------------------------------------

def make_run(tmp_path, *overrides, plugins=()):
    return csf.Run(fixtures.compose(*overrides), plugins=list(plugins), output_dir=tmp_path)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_names(run_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir / "checkpoints")]


def plugin(name: str, **hooks):
    """A plugin object named ``name`` whose hooks are the given functions (each marked ``hookimpl``)."""
    attrs = {"name": name}
    for hook, function in hooks.items():
        attrs[hook] = staticmethod(csf.hookimpl(function))
    return type(name.title().replace("_", ""), (), attrs)()


def test_a_misspelled_hook_is_refused_naming_plugin_hook_and_the_likely_one(tmp_path):
    typo = plugin("typo", on_train_batch_ends=lambda run: None)
    with pytest.raises(csf.ConfigError) as info:
        make_run(tmp_path, plugins=[typo])
    message = str(info.value)
    assert "plugin 'typo'" in message and "'on_train_batch_ends' is not a csframework hook" in message
    assert "did you mean 'on_train_batch_end'?" in message
    assert info.value.exit_code == 2
    assert not any(tmp_path.iterdir())


def test_a_hook_name_like_no_hook_still_names_where_the_hooks_are(tmp_path):
    with pytest.raises(csf.ConfigError, match="'frobnicate' is not a csframework hook .see csframework/hookspecs"):
        make_run(tmp_path, plugins=[plugin("odd", frobnicate=lambda run: None)])


def test_an_optional_hook_of_another_project_is_allowed(tmp_path):
    class Forward:
        name = "forward"

        @csf.hookimpl(optionalhook=True)
        def on_future_hook(self, run):
            raise AssertionError("never called")

    assert make_run(tmp_path, plugins=[Forward()]).fit()["status"] == "completed"


def test_an_argument_the_hook_lacks_is_refused_naming_it_and_the_hooks_arguments(tmp_path):
    wrong = plugin("wrong_args", on_train_batch_end=lambda run, step: None)
    with pytest.raises(csf.ConfigError) as info:
        make_run(tmp_path, plugins=[wrong])
    assert str(info.value) == ("plugin 'wrong_args': hook 'on_train_batch_end' has no argument 'step' (its "
                               "arguments: run, batch, outputs, batch_idx); take any subset of them, by name")
    assert info.value.exit_code == 2


@pytest.mark.parametrize("code", [0, None, 3, "bye"])
def test_sys_exit_in_a_hook_fails_the_run_naming_plugin_and_hook(tmp_path, code):
    def on_train_batch_end(run):
        if run.global_step == 5:
            sys.exit(code)

    with pytest.raises(csf.PluginError) as info:
        make_run(tmp_path, "checkpoint.every_steps=2",
                 plugins=[plugin("quitter", on_train_batch_end=on_train_batch_end)]).fit()
    assert (info.value.plugin, info.value.hook, info.value.exit_code) == ("quitter", "on_train_batch_end", 1)
    assert f"raised SystemExit({code!r})" in str(info.value)
    assert isinstance(info.value.error, SystemExit)
    done = summary(tmp_path)
    assert done["status"] == "failed" and done["global_step"] == 5 and "quitter" in done["error"]
    assert checkpoint_names(tmp_path) == ["step-00000002", "step-00000004"]


def test_sys_exit_while_the_run_is_built_is_named_too(tmp_path):
    with pytest.raises(csf.PluginError, match="plugin 'quitter' in hook 'csframework_configure' failed: it "
                                              r"raised SystemExit\(0\)"):
        make_run(tmp_path, plugins=[plugin("quitter", csframework_configure=lambda config: sys.exit(0))])


def test_a_keyboard_interrupt_from_a_hook_still_propagates_unchanged(tmp_path):
    stop = KeyboardInterrupt("user")

    def on_train_batch_end(run):
        if run.global_step == 3:
            raise stop

    with pytest.raises(KeyboardInterrupt) as info:
        make_run(tmp_path, plugins=[plugin("ctrl_c", on_train_batch_end=on_train_batch_end)]).fit()
    assert info.value is stop
    assert summary(tmp_path)["status"] == "interrupted"


@pytest.mark.parametrize("result, problems", [
    (None, []), ([], []), (["loop.max_steps: too many; lower it"], ["loop.max_steps: too many; lower it"]),
    ("loop.max_steps: too many; lower it", ["loop.max_steps: too many; lower it"]),
])
def test_validate_may_return_none_a_list_of_strings_or_one_string(tmp_path, result, problems):
    judge = plugin("judge", csframework_validate=lambda config: result)
    if not problems:
        make_run(tmp_path, plugins=[judge])
        return
    with pytest.raises(csf.ValidationError) as info:
        make_run(tmp_path, plugins=[judge])
    assert info.value.problems == problems and info.value.exit_code == 2


@pytest.mark.parametrize("result, described", [
    ({"loop.max_steps": "too many"}, "it returned a value of type dict ({'loop.max_steps': 'too many'})"),
    (["fine", 3], "it returned a list holding a value of type int (3)"),
    ([["nested"]], "it returned a list holding a value of type list"),
    (7, "it returned a value of type int (7)"),
    (True, "it returned a value of type bool"),
    (False, "it returned a value of type bool"),
])
def test_validate_results_of_another_kind_are_refused_naming_the_plugin(tmp_path, result, described):
    with pytest.raises(csf.PluginError) as info:
        make_run(tmp_path, plugins=[plugin("sloppy", csframework_validate=lambda config: result)])
    assert (info.value.plugin, info.value.hook, info.value.exit_code) == ("sloppy", "csframework_validate", 1)
    assert described in str(info.value) and "return None or a list of strings" in str(info.value)
    assert not any(tmp_path.iterdir())


def test_state_json_cannot_hold_is_named_by_plugin_and_key_and_nothing_is_misreported(tmp_path):
    import torch

    def on_checkpoint_save(run, state):
        state["tensorish"] = {"best": [1.0, torch.tensor(0.5)] if run.global_step == 6 else [1.0]}

    with pytest.raises(csf.PluginError) as info:
        make_run(tmp_path, "checkpoint.every_steps=2",
                 plugins=[plugin("tensorish", on_checkpoint_save=on_checkpoint_save)]).fit()
    message = str(info.value)
    assert (info.value.plugin, info.value.hook, info.value.exit_code) == ("tensorish", "on_checkpoint_save", 1)
    assert "state['tensorish']['best'][1] is of type Tensor" in message
    assert "no checkpoint of step 6 was written" in message
    done = summary(tmp_path)
    assert done["status"] == "failed" and done["global_step"] == 6
    assert checkpoint_names(tmp_path) == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "index.json", "step-00000002", "step-00000004"]
    _, meta = read_checkpoint(tmp_path / "checkpoints" / "step-00000004")
    assert meta["plugins"] == {"tensorish": {"best": [1.0]}}
    saved = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in saved if e["event"] == "checkpoint_saved"] == [2, 4]


def test_a_value_put_under_another_plugins_key_is_blamed_on_the_plugin_that_put_it(tmp_path):
    def honest(run, state):
        state["honest"] = {"seen": run.global_step}

    def meddler(run, state):
        state["honest"]["extra"] = object()

    with pytest.raises(csf.PluginError) as info:  # honest is registered last, so it is called first
        make_run(tmp_path, plugins=[plugin("meddler", on_checkpoint_save=meddler),
                                    plugin("honest", on_checkpoint_save=honest)]).fit()
    assert info.value.plugin == "meddler"
    assert "state['honest']['extra'] is of type object" in str(info.value)
    assert not (tmp_path / "checkpoints" / "step-00000008").exists()


def test_a_circular_state_is_named_not_a_recursion_error(tmp_path):
    def loop(run, state):
        state["loop"] = {"me": None}
        state["loop"]["me"] = state["loop"]

    with pytest.raises(csf.PluginError, match=r"state\['loop'\]\['me'\] refers back to itself"):
        make_run(tmp_path, plugins=[plugin("loop", on_checkpoint_save=loop)]).fit()


def test_nan_and_infinities_in_state_are_kept_as_python_json_writes_and_reads_them(tmp_path):
    """Documented choice: allowed, since ``best = float("inf")`` is the usual start of a running best."""
    loaded = []
    saver = plugin("best", on_checkpoint_save=lambda state: state.update(best={"loss": math.inf, "x": math.nan}))
    make_run(tmp_path, plugins=[saver]).fit()
    loader = plugin("best", on_checkpoint_load=lambda state: loaded.append(state["best"]))
    make_run(tmp_path, "checkpoint.resume=auto", "loop.max_steps=9", plugins=[loader]).fit()
    assert loaded[0]["loss"] == math.inf and math.isnan(loaded[0]["x"])


@pytest.mark.parametrize("hook, change, key", [
    ("on_fit_start", lambda run: setattr(run.config.optimizer, "lr", 1.0), "optimizer.lr"),
    ("on_train_batch_end", lambda run: setattr(run.stage_config.loop, "max_steps", 100), "loop.max_steps"),
    ("on_train_start", lambda run: run.config.model.net.__setitem__("hidden", 3), "model.net.hidden"),
    ("on_fit_start", lambda run: run.config.data.train.update(n=3), "data.train.n"),
    ("on_fit_start", lambda run: run.config.plugins.disable.append("logging"), "plugins.disable"),
    ("on_fit_start", lambda run: delattr(run.config, "seed"), "seed"),
])
def test_a_plugin_changing_the_config_fails_the_run_naming_the_key(tmp_path, hook, change, key):
    with pytest.raises(csf.PluginError) as info:
        make_run(tmp_path, plugins=[plugin("tinkerer", **{hook: change})]).fit()
    assert (info.value.plugin, info.value.hook, info.value.exit_code) == ("tinkerer", hook, 1)
    assert "run.config is read-only while the run runs: " + key in str(info.value)
    assert summary(tmp_path)["status"] == "failed"


def test_stage_configs_are_read_only_and_staged_runs_still_work(tmp_path):
    seen = []

    def on_train_start(run):
        try:
            run.stage_config.optimizer.lr = 9.0
        except AttributeError as e:  # ReadOnlyConfigError is one, as a frozen dataclass's error is
            seen.append((run.stage, run.stage_config.optimizer.lr, str(e)))

    stages = "+stages={first:{loop:{max_steps:2}},second:{loop:{max_steps:4},optimizer:{lr:0.05}}}"
    done = make_run(tmp_path, stages, plugins=[plugin("stager", on_train_start=on_train_start)]).fit()
    assert done["status"] == "completed" and done["global_step"] == 6  # 2 + 4 steps
    assert [(stage, lr) for stage, lr, _ in seen] == [("first", 0.1), ("second", 0.05)]
    assert seen[1][2].startswith("run.stage_config (stage second) is read-only while the run runs: "
                                 "optimizer.lr cannot be changed")


def test_configure_may_still_adjust_the_config_and_the_callers_config_is_untouched(tmp_path):
    def csframework_configure(config):
        config.loop.max_steps = 4

    cfg = fixtures.compose()
    run = csf.Run(cfg, plugins=[plugin("tuner", csframework_configure=csframework_configure)], output_dir=tmp_path)
    assert run.fit()["global_step"] == 4
    assert cfg.loop.max_steps == 8
    cfg.loop.max_steps = 2  # the caller's config stays theirs to change
    thawed = copy.deepcopy(run.config)  # a copy of a run's config is an ordinary config
    thawed.model["net"]["hidden"] = 32
    assert isinstance(thawed.model, dict) and run.config.model.net.hidden == 16


def test_a_plugin_failing_in_on_exception_masks_neither_the_error_nor_the_others_clean_up(tmp_path, capsys, caplog):
    def on_train_batch_end(run):
        if run.global_step == 3:
            raise ValueError("the original")

    def on_exception(run, error):
        raise RuntimeError("the clean-up failed too")

    with pytest.raises(csf.PluginError, match="ValueError: the original"):
        make_run(tmp_path, plugins=[plugin("first", on_train_batch_end=on_train_batch_end),
                                    plugin("careless", on_exception=on_exception)]).fit()
    # the console is stdlib logging (pytest's handlers here; stderr when nothing is configured)
    console = capsys.readouterr().err + caplog.text
    assert "on_exception_failed" in console and "careless" in console and "the clean-up failed too" in console
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # the logging plugin's on_exception (which runs after user plugins) still recorded the failure
    assert events[-1]["event"] == "fit_failed" and "the original" in events[-1]["error"]
    assert summary(tmp_path)["status"] == "failed"


CLI_PLUGINS = {
    "typo_plugin": """
        @hookimpl
        def on_train_batch_ends(run):
            pass
    """,
    "exit_plugin": """
        @hookimpl
        def on_train_batch_end(run):
            if run.global_step == 3:
                sys.exit(0)
    """,
    "config_plugin": """
        @hookimpl
        def on_train_batch_end(run):
            if run.global_step == 3:
                run.config.optimizer.lr = 1.0
    """,
    "validate_plugin": """
        @hookimpl
        def csframework_validate(config):
            return {"optimizer.lr": "too high"}
    """,
    "state_plugin": """
        @hookimpl
        def on_checkpoint_save(run, state):
            state["state_plugin"] = {"at": run.global_step, "model": run.model if run.global_step > 2 else None}
    """,
}


# (module, exit status, what stderr names, checkpoints left)
CLI_CASES = [
    ("typo_plugin", 2, "plugin 'typo_plugin': 'on_train_batch_ends' is not a csframework hook (did you mean "
                       "'on_train_batch_end'?)", None),
    ("exit_plugin", 1, ("training step 3 failed in plugin 'exit_plugin', hook 'on_train_batch_end' (",
                        "exit_plugin.py:7): SystemExit: 0; the traceback is in"), ["step-00000002"]),
    ("config_plugin", 1, "plugin 'config_plugin' in hook 'on_train_batch_end' failed: ReadOnlyConfigError: "
                         "run.config is read-only while the run runs: optimizer.lr cannot be changed",
     ["step-00000002"]),
    ("validate_plugin", 1, "plugin 'validate_plugin' in hook 'csframework_validate' failed: TypeError: it "
                           "returned a value of type dict", None),
    ("state_plugin", 1, "training step 4 failed in plugin 'state_plugin', hook 'on_checkpoint_save': TypeError: "
                        "state['state_plugin']['model'] is of type Supervised", ["step-00000002"]),
]


@pytest.mark.slow
def test_each_misbehaviour_exits_with_its_status_in_one_line(tmp_path, cli_env):
    for module, body in CLI_PLUGINS.items():
        (tmp_path / f"{module}.py").write_text("import sys\nfrom csframework import hookimpl\n"
                                               + textwrap.dedent(body))
    env = dict(cli_env, PYTHONPATH=os.pathsep.join([str(tmp_path), cli_env["PYTHONPATH"]]))
    chains = [[{"argv": ["--config-dir", fixtures.CONF, *fixtures.TINY, "checkpoint.every_steps=2",
                         f"plugins.enable=[{module}]", f"hydra.run.dir={tmp_path / module}"]}]
              for module, *_ in CLI_CASES]
    results = [chain[0] for chain in run_chains(chains, env)]
    for (module, status, named, checkpoints), result in zip(CLI_CASES, results):
        stderr = result["stderr"]
        assert result["returncode"] == status, (module, stderr[-2000:])
        assert "Traceback" not in stderr, (module, stderr)
        errors = [line for line in stderr.splitlines() if line.startswith("csframework: error:")]
        parts = named if isinstance(named, tuple) else (named,)
        assert len(errors) == 1 and all(part in errors[0] for part in parts), (module, stderr)
        run_dir = tmp_path / module
        if checkpoints is None:  # refused before anything was built
            assert not (run_dir / "checkpoints").exists() and not (run_dir / "summary.json").exists(), module
        else:
            assert checkpoint_names(run_dir) == checkpoints, module
            assert summary(run_dir)["status"] == "failed", module
            assert summary(run_dir)["global_step"] == (4 if module == "state_plugin" else 3), module


# -- plugin config sections (issue 27, item 6) --------------------------------------------------------------
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


def built(plugin, output_dir, *overrides):
    """A tiny run with ``plugin``, composed with it (its section) and then built."""
    return csf.Run(csf.compose([*TINY_RUN, *overrides], plugins=[plugin]), plugins=[plugin], output_dir=output_dir)


@pytest.mark.parametrize("section", ["a.b", "_target_", "_self_", "hydra", "defaults", "1st", "class", "selected",
                                     "a b", "ünï", "line\nbreak", "", 3])
def test_a_section_with_a_reserved_or_invalid_name_is_refused_naming_plugin_and_section(tmp_path, section):
    with pytest.raises(ConfigError) as caught:
        built(section_plugin(section), tmp_path / "run")
    message = one_line(caught.value)
    assert caught.value.exit_code == 2
    assert message.startswith(f"plugin 'sections' declares config section {section!r}, which "), message
    assert message.endswith("the plugin must name its section differently")
    assert not (tmp_path / "run").exists(), "nothing was written"


def test_a_valid_section_name_still_composes(tmp_path):
    run = built(section_plugin("my_section2"), tmp_path, "my_section2.value=4")
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
        built(section_plugin("mine", schema), tmp_path)
    message = one_line(caught.value)
    assert caught.value.exit_code == 2
    assert message.startswith(f"mine: plugin 'sections' declares config section 'mine' {detail}"), message


def test_a_module_path_among_the_plugins_is_imported_and_registered_once():
    """``csf.compose(plugins=["pkg.module"])`` names a plugin module as ``plugins.enable`` does (a string
    was registered as a string before: silently no plugin); the same module given twice is registered once."""
    import sweep_plugin

    assert build_manager([], extra=["sweep_plugin"]).is_registered(sweep_plugin)
    twice = build_manager([], extra=["sweep_plugin", sweep_plugin])
    assert [p for p in twice.get_plugins() if p is sweep_plugin] == [sweep_plugin]
    assert not [p for p in twice.get_plugins() if isinstance(p, str)]


# -- a plugin with a section enabled from a config file (issue 49 item 10) ----------------------------------
FILE_PLUGIN = '''
from dataclasses import dataclass

import csframework as csf


@dataclass
class Shown:
    value: int = 0


@csf.hookimpl
def csframework_config_sections():
    return {"file_section": Shown}


@csf.hookimpl
def on_fit_start(run):
    run.log.info("file_section_value", value=run.config.file_section.value)
'''


@pytest.fixture
def file_configs(tmp_path, monkeypatch):
    """A module plugin with a config section, an experiment file and a primary config that enable it and set
    the section, in a config directory that searches the test configs too."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "file_section_plugin.py").write_text(FILE_PLUGIN)
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "with_section.yaml").write_text(
        "# @package _global_\nplugins:\n  enable: [file_section_plugin]\nfile_section:\n  value: 5\n")
    (conf / "primary.yaml").write_text("defaults:\n  - config\n  - _self_\n"
                                       "plugins:\n  enable: [file_section_plugin]\nfile_section:\n  value: 6\n")
    return conf


def test_a_plugin_with_a_section_can_be_enabled_and_set_from_config_files(file_configs):
    search = f"hydra.searchpath=[file://{fixtures.CONF}]"
    config = csf.compose([*fixtures.TINY, search, "+experiment=with_section"], config_dir=str(file_configs))
    assert config.file_section.value == 5 and list(config.plugins.enable) == ["file_section_plugin"]
    config = csf.compose([*fixtures.TINY, search, "file_section.value=7"], config_dir=str(file_configs),
                         config_name="primary")
    assert config.file_section.value == 7
    with pytest.raises(ConfigError, match=r"^file_section\.valu: .*did you mean `file_section\.value`"):
        csf.compose([*fixtures.TINY, search, "+experiment=with_section", "file_section.valu=1"],
                     config_dir=str(file_configs))
    with pytest.raises(ConfigError, match=r"^file_section: Key 'file_section' not in 'RunConfig'"):
        csf.compose([*fixtures.TINY, search, "file_section.value=1"], config_dir=str(file_configs))  # not enabled


@pytest.mark.slow
def test_the_command_line_runs_a_plugin_a_config_file_enables_with_its_section(file_configs, tmp_path, cli_env):
    env = dict(cli_env, PYTHONPATH=os.pathsep.join([str(tmp_path), cli_env["PYTHONPATH"]]))
    run_dir = tmp_path / "run"
    [[result]] = run_chains([[{"argv": ["--config-dir", str(file_configs), *fixtures.TINY, "loop.max_steps=1",
                                        f"hydra.searchpath=[file://{fixtures.CONF}]", "+experiment=with_section",
                                        f"hydra.run.dir={run_dir}"]}]], env)
    assert result["returncode"] == 0, result["stderr"][-2000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e.get("value") for e in events if e.get("event") == "file_section_value"] == [5]

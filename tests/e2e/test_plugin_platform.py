"""The plugin platform (issue 11): config sections declared by plugins, registration of classes, modules
and instances, disable before import, ``run.request_stop`` and ``checkpoint.keep_best``.

Entry-point plugins come from a real distribution built here and installed with ``pip install --target``
(its ``dist-info`` carries the entry points); runs see it through ``PYTHONPATH`` / ``sys.path`` and
``CSFRAMEWORK_PLUGINS_AUTOLOAD`` naming the entry points a test wants.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import csframework as csf
from csframework.testing import CsfRunner, RunResult
from fixtures import pip_install_target

DEMO = '''
"""A demo plugin distribution: a class with a config section, a module, an instance."""
from dataclasses import dataclass, field
from typing import List

import csframework as csf


@dataclass
class GreeterConfig:
    greeting: str = "hi"
    times: int = 1
    names: List[str] = field(default_factory=list)


class Greeter:
    name = "not-the-entry-point-name"

    def __init__(self):
        self.steps = 0  # per instance: a class plugin starts every run afresh

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"greeter": GreeterConfig}

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.steps += 1
        cfg = run.stage_config.greeter
        run.summary_extra["greeter"] = {"greeting": cfg.greeting, "times": cfg.times, "names": list(cfg.names),
                                        "type": type(cfg.times).__name__, "steps": self.steps}


class Counter:
    def __init__(self):
        self.steps = 0

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.steps += 1
        run.summary_extra["instance_steps"] = self.steps


INSTANCE = Counter()
'''
DEMO_MODULE = '''
import csframework as csf

steps = 0


@csf.hookimpl
def on_train_batch_end(run):
    global steps
    steps += 1
    run.summary_extra["module_steps"] = steps
'''
PYPROJECT = '''
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "csf-demo"
version = "0.1"

[project.entry-points."csframework.plugins"]
greeter = "csf_demo:Greeter"
counter_module = "csf_demo_module"
counter_instance = "csf_demo:INSTANCE"
broken = "csf_demo_broken"

[tool.setuptools]
py-modules = ["csf_demo", "csf_demo_module", "csf_demo_broken"]
'''
ALL = "greeter,counter_module,counter_instance"


@pytest.fixture(scope="module")
def demo_site(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("csf-demo-src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "csf_demo.py").write_text(DEMO)
    (src / "csf_demo_module.py").write_text(DEMO_MODULE)
    (src / "csf_demo_broken.py").write_text("import a_module_that_is_not_installed\n")
    site = tmp_path_factory.mktemp("csf-demo-site")
    pip_install_target(src, site)
    assert (site / "csf_demo-0.1.dist-info" / "entry_points.txt").exists()
    return site


@pytest.fixture
def installed(demo_site, monkeypatch):
    """The demo distribution importable in this process; the entry points a test wants are set with
    ``monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", ...)`` (default: all but the broken one)."""
    monkeypatch.syspath_prepend(str(demo_site))
    monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", ALL)
    yield demo_site
    for name in ("csf_demo", "csf_demo_module"):
        sys.modules.pop(name, None)  # a module plugin's state is per process; start each test afresh


@pytest.fixture
def runner(tmp_path):
    return CsfRunner(tmp_path)


def cli(runner, demo_site, *args, autoload=ALL, **kwargs) -> RunResult:
    env = {"PYTHONPATH": os.pathsep.join([str(demo_site), os.environ.get("PYTHONPATH", "")])}
    return runner.cli(list(args), autoload=autoload.split(","), env=env, **kwargs)


# -- 1. config sections --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_section_from_the_command_line_typed_and_checked(runner, demo_site):
    ok = cli(runner, demo_site, "greeter.times=3", "greeter.names=[a,b]")
    assert ok.exit_code == 0, ok.stderr[-3000:]
    assert ok.summary["greeter"] == {"greeting": "hi", "times": 3, "names": ["a", "b"], "type": "int",
                                     "steps": 20}
    wrong = cli(runner, demo_site, "greeter.times=thrice")
    assert wrong.exit_code == 2 and "csframework: error: greeter.times:" in wrong.stderr
    unknown = cli(runner, demo_site, "greeter.tims=3")
    assert unknown.exit_code == 2 and "greeter.tims" in unknown.stderr
    assert "Traceback" not in wrong.stderr + unknown.stderr

    shown = cli(runner, demo_site, "--cfg", "job", "greeter.greeting=hello")
    assert shown.exit_code == 0 and "greeter:\n  greeting: hello\n  times: 1\n" in shown.stdout
    helped = cli(runner, demo_site, "--help")
    assert helped.exit_code == 0 and "greeter:\n  greeting: hi\n" in helped.stdout


def test_a_section_from_a_user_yaml_via_run_and_in_a_stage(installed, tmp_path, runner):
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "hello.yaml").write_text("# @package _global_\ngreeter:\n  greeting: hello\n")
    config = csf.compose(["+experiment=hello", "greeter.times=2", *runner_overrides()], config_dir=str(conf))
    assert config.greeter.greeting == "hello" and config.greeter.times == 2  # attribute access, typed
    summary = csf.Run(config, output_dir=tmp_path / "run").fit()
    assert summary["greeter"]["greeting"] == "hello" and summary["greeter"]["times"] == 2

    staged = runner.run(["+stages.warm.loop.max_steps=4", "+stages.warm.greeter.times=7",
                         "+stages.main.loop.max_steps=4"])
    assert staged.exit_code == 0, staged.error
    assert staged.summary["greeter"]["times"] == 1  # the last stage's own value: the base's


def runner_overrides() -> list[str]:
    from csframework.testing import TINY_RUN

    return [*TINY_RUN, "loop.max_steps=4"]


def section_module(tmp_path, monkeypatch, name: str, section: str) -> str:
    """A module plugin (for plugins.enable) declaring config section ``section``."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f'''
        from dataclasses import dataclass
        import csframework as csf

        @dataclass
        class Section:
            value: int = 0

        @csf.hookimpl
        def csframework_config_sections():
            return {{"{section}": Section}}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_sections_that_collide_are_refused_naming_the_plugins(installed, tmp_path, monkeypatch, runner):
    mine = section_module(tmp_path, monkeypatch, "csf_second_greeter", "greeter")
    both = runner.run([f"plugins.enable=[{mine}]"])
    assert both.exit_code == 2
    assert str(both.error) == ("greeter: plugins 'greeter' and 'csf_second_greeter' both declare config section "
                               "'greeter'; turn one off with plugins.disable=[csf_second_greeter]")
    assert runner.run([f"plugins.enable=[{mine}]", "plugins.disable=[greeter]"]).exit_code == 0

    builtin = section_module(tmp_path, monkeypatch, "csf_loop_plugin", "loop")
    clash = runner.run([f"plugins.enable=[{builtin}]"])
    assert clash.exit_code == 2
    assert str(clash.error).startswith("loop: plugin 'csf_loop_plugin' declares config section 'loop', which is "
                                       "a built-in key")


def test_plugins_enable_declares_a_section_but_run_plugins_cannot(tmp_path, monkeypatch, runner):
    mine = section_module(tmp_path, monkeypatch, "csf_extra_section", "extra")
    ok = runner.run([f"plugins.enable=[{mine}]", "extra.value=3"])
    assert ok.exit_code == 0, ok.error
    import csf_extra_section

    late = runner.run([], plugins=[csf_extra_section])
    assert late.exit_code == 2
    assert "extra: plugin 'csf_extra_section' declares config section 'extra', but the config was composed " \
           "without it" in str(late.error)
    assert csf.compose(["extra.value=4"], plugins=[csf_extra_section]).extra.value == 4  # known to compose


def test_a_plugin_section_is_read_only_during_the_run(tmp_path, monkeypatch, runner):
    mine = section_module(tmp_path, monkeypatch, "csf_changing_section", "changing")

    class Changes:
        @csf.hookimpl
        def on_fit_start(self, run):
            run.config.changing.value = 5

    result = runner.run([f"plugins.enable=[{mine}]"], plugins=[Changes])
    assert result.exit_code != 0
    assert "run.config is read-only while the run runs: changing.value cannot be changed" in str(result.error)


def test_a_disabled_plugin_has_no_section(installed, runner):
    result = runner.run(["plugins.disable=[greeter]", "greeter.times=2"])
    assert result.exit_code == 2
    assert str(result.error) == ("greeter.times: plugin 'greeter' is disabled (plugins.disable), so its config "
                                 "section is gone; remove the setting or enable the plugin")
    off = runner.run(["plugins.disable=[greeter]"])
    assert off.exit_code == 0 and "greeter" not in off.summary


@pytest.mark.slow
def test_a_disabled_plugin_s_setting_on_the_command_line_says_so_as_the_api_does(runner, demo_site):
    """Issue 29, item 5: the CLI said ``Key 'greeter' not in 'RunConfig'``."""
    refused = cli(runner, demo_site, "plugins.disable=[greeter]", "greeter.times=2")
    assert refused.exit_code == 2
    assert [line for line in refused.stderr.splitlines() if line.strip()] == [
        "csframework: error: greeter.times: plugin 'greeter' is disabled (plugins.disable), so its config section "
        "is gone; remove the setting or enable the plugin"]


# -- 2. registration -----------------------------------------------------------------------------------
def test_entry_points_naming_a_class_a_module_and_an_instance(installed, runner, csf_hook_recorder):
    result = runner.run(["loop.max_steps=6"], plugins=[csf_hook_recorder])
    assert result.exit_code == 0, result.error
    # each plugin's on_train_batch_end ran once per step
    assert result.summary["greeter"]["steps"] == 6
    assert result.summary["module_steps"] == 6 and result.summary["instance_steps"] == 6
    assert csf_hook_recorder.names().count("on_train_batch_end") == 6


def test_a_plugin_class_in_run_plugins_is_instantiated_once_per_run(runner):
    created = []

    class Fresh:
        def __init__(self):
            created.append(self)
            self.steps = 0

        @csf.hookimpl
        def on_train_batch_end(self, run):
            self.steps += 1
            run.summary_extra["fresh_steps"] = self.steps

    first = runner.run(["loop.max_steps=3"], plugins=[Fresh])
    second = runner.run(["loop.max_steps=3"], plugins=[Fresh])
    assert first.summary["fresh_steps"] == second.summary["fresh_steps"] == 3
    assert len(created) == 2


def test_a_failing_plugin_is_named_by_its_name(installed, runner):
    class Raises:
        @csf.hookimpl
        def on_train_batch_end(self, run):
            if run.global_step == 2:
                raise ValueError("bad step")

    result = runner.run([], plugins=[Raises])
    assert result.exit_code == 1
    assert str(result.error) == "plugin 'Raises' in hook 'on_train_batch_end' failed: ValueError: bad step"


@pytest.mark.slow
def test_a_class_plugin_starts_each_job_of_a_multirun_afresh(runner, demo_site):
    sweep = cli(runner, demo_site, "-m", "loop.max_steps=3", "seed=1,2,3")
    assert sweep.exit_code == 0, sweep.stderr[-3000:]
    for job in ("0", "1", "2"):
        summary = json.loads((sweep.output_dir / job / "summary.json").read_text())
        assert summary["greeter"]["steps"] == 3  # not 6, 9: no state shared between jobs
        assert summary["instance_steps"] == 3 * (int(job) + 1)  # an instance (or module) is shared


# -- 3. disable before import --------------------------------------------------------------------------
def test_a_broken_installed_plugin_is_named_and_can_be_disabled(installed, runner, monkeypatch):
    monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", "greeter,broken")
    failed = runner.run(["loop.max_steps=2"])
    assert failed.exit_code == 1
    assert str(failed.error) == ("plugin 'broken' (distribution csf-demo 0.1) failed to load: ModuleNotFoundError: "
                                 "No module named 'a_module_that_is_not_installed'; turn it off with "
                                 "plugins.disable=[broken]")
    assert not failed.output_dir.exists()
    ok = runner.run(["loop.max_steps=2", "plugins.disable=[broken]"])
    assert ok.exit_code == 0, ok.error
    assert "csf_demo_broken" not in sys.modules


@pytest.mark.slow
def test_a_broken_installed_plugin_from_the_command_line(runner, demo_site):
    failed = cli(runner, demo_site, "loop.max_steps=2", autoload="broken")
    assert failed.exit_code == 1
    assert failed.stderr.strip().splitlines()[-1] == (
        "csframework: error: plugin 'broken' (distribution csf-demo 0.1) failed to load: ModuleNotFoundError: No "
        "module named 'a_module_that_is_not_installed'; turn it off with plugins.disable=[broken]")
    ok = cli(runner, demo_site, "loop.max_steps=2", "plugins.disable=[broken]", autoload="broken")
    assert ok.exit_code == 0, ok.stderr[-3000:]


# -- 4. request_stop -----------------------------------------------------------------------------------
class StopAt:
    def __init__(self, step):
        self.step = step

    @csf.hookimpl
    def on_train_batch_end(self, run):
        if run.global_step == self.step:
            run.request_stop(f"budget reached at step {self.step}")


def test_request_stop_ends_the_run_normally_after_the_step(runner):
    result = runner.run(["+stages.a.loop.max_steps=20", "+stages.b.loop.max_steps=5"], plugins=[StopAt(7)])
    assert result.exit_code == 0, result.error
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 7
    assert result.summary["stop_reason"] == "budget reached at step 7"
    assert result.summary["stage"] == "a"  # stage b never started
    assert result.series("val/loss")[-1][0] == 7  # the final evaluation ran at the stopping step
    assert json.loads((result.output_dir / "checkpoints" / "index.json").read_text())["checkpoints"][-1] \
        == "step-00000007"
    assert [e["reason"] for e in result.events if e.get("event") == "stop_requested"] == ["budget reached at step 7"]


# -- checkpoint.keep_best ------------------------------------------------------------------------------
def test_keep_best_keeps_the_best_checkpoint_besides_keep_last(runner):
    # val/loss falls throughout, so with mode=max the first evaluation's checkpoint is the "best" one
    over = ["checkpoint.every_steps=5", "checkpoint.keep_last=1", "checkpoint.keep_best.monitor=val/loss"]
    result = runner.run([*over, "checkpoint.keep_best.mode=max"])
    assert result.exit_code == 0, result.error
    first_val = result.series("val/loss")[0]
    assert first_val[0] == 5
    assert result.summary["best_checkpoint"] == {"path": "checkpoints/step-00000005", "metric": "val/loss",
                                                 "value": first_val[1]}
    assert sorted(p.name for p in (result.output_dir / "checkpoints").glob("step-*")) == [
        "step-00000005", "step-00000020"]
    assert (result.output_dir / result.summary["best_checkpoint"]["path"] / "state.pt").exists()

    lowest = runner.run([*over])  # mode=min: the newest is also the best; one checkpoint
    assert lowest.summary["best_checkpoint"]["path"] == "checkpoints/step-00000020"
    assert sorted(p.name for p in (lowest.output_dir / "checkpoints").glob("step-*")) == ["step-00000020"]

    refused = runner.run(["checkpoint.keep_best.monitor=val/loss", "data.val=null"])
    assert refused.exit_code == 2 and "checkpoint.keep_best.monitor: val/loss comes from evaluation" in str(
        refused.error)

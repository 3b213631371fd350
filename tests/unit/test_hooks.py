"""``csframework.hooks``, hook dispatch in one place: plain implementations are called directly, in pluggy's
order with pluggy's results; wrappers and a traced or monitored manager go through pluggy; a failing
implementation is named; a ``firstresult`` hook returns its first result; no private pluggy name is used."""
from __future__ import annotations

import types

import pytest

import csframework as csf
from csframework.backends.eager import EagerPlugin
from csframework.errors import PluginError
from csframework.plugins import Hooks, build_manager


def _Recorder(name, calls, result=None, **marks):
    """A plugin on on_train_batch_end that records the order it is called in and returns ``result``."""
    def on_train_batch_end(batch_idx, outputs):
        calls.append((name, batch_idx, outputs))
        return result

    return types.SimpleNamespace(name=name, on_train_batch_end=csf.hookimpl(**marks)(on_train_batch_end))


def _manager(*plugins):
    pm = build_manager([])
    for plugin in plugins:
        pm.register(plugin, name=plugin.name)
    return pm


def test_plain_implementations_are_called_as_pluggy_calls_them():
    """The direct call of plain implementations: pluggy's order (tryfirst first, the last registered before
    the earlier ones, trylast last), only the arguments each names, the results that are not None."""
    pm_calls, direct_calls = [], []
    for calls in (pm_calls, direct_calls):
        plugins = [_Recorder("a", calls, 1), _Recorder("b", calls), _Recorder("first", calls, 3, tryfirst=True),
                   _Recorder("last", calls, 4, trylast=True), _Recorder("c", calls, 2)]
        pm = _manager(*plugins)
        kwargs = dict(run=None, batch=None, outputs={"loss": 1}, batch_idx=7)
        results = (pm.hook if calls is pm_calls else Hooks(pm)).on_train_batch_end(**kwargs)
        assert results == [3, 2, 1, 4]
    assert direct_calls == pm_calls == [(n, 7, {"loss": 1}) for n in ("first", "c", "b", "a", "last")]


def test_a_wrapper_or_a_monitored_manager_goes_through_pluggy():
    calls, seen = [], []

    class Wrapper:
        name = "wrapper"

        @csf.hookimpl(wrapper=True)
        def on_train_batch_end(self):
            results = yield
            seen.append(("wrapped", results))
            return results

    hooks = Hooks(_manager(_Recorder("a", calls, 1), Wrapper()))
    assert hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=0) == [1]
    assert seen == [("wrapped", [1])]

    pm = _manager(_Recorder("a", calls, 1))
    hooks = Hooks(pm)
    undo = pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append(("before", name)),
                                      lambda outcome, name, impls, kwargs: seen.append(("after", name)))
    hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=0)
    assert seen[1:] == [("before", "on_train_batch_end"), ("after", "on_train_batch_end")]
    undo()
    hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=0)
    assert len(seen) == 3 and len(calls) == 3  # not monitored any more, called all the same


def test_a_failing_plain_implementation_is_named_and_stops_the_call():
    calls = []

    class Broken:
        name = "broken"

        @csf.hookimpl
        def on_train_batch_end(self, batch_idx):
            raise ValueError(f"bad batch {batch_idx}")

    hooks = Hooks(_manager(_Recorder("a", calls), Broken()))  # Broken is called first (registered last)
    with pytest.raises(PluginError, match=r"plugin 'broken' in hook 'on_train_batch_end' failed: ValueError: "
                                          r"bad batch 3"):
        hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=3)
    assert calls == []  # as in pluggy: the implementations after the failing one are not called


def test_a_firstresult_hook_returns_the_first_result_directly():
    class Mine:
        name = "mine"

        @csf.hookimpl
        def csframework_backend(self, device_type):
            return "mine" if device_type == "TPU" else None

    hooks = Hooks(_manager(Mine(), EagerPlugin()))
    assert hooks.csframework_backend(device_type="TPU") == "mine"
    assert hooks.csframework_backend(device_type="XLA") is None
    assert hooks.csframework_backend(device_type="CPU") is not None


def test_no_private_pluggy_name_is_used_anywhere_in_the_package():
    """Dispatch is on pluggy's public API only: an upgrade of pluggy cannot break every run."""
    import re
    from pathlib import Path

    import csframework

    private = re.compile(r"pluggy\._|from pluggy\.\w*_|\._(?:inner_hookexec|hookexec|multicall|plugin2hookcallers)\b")
    found = [f"{path.name}:{n}" for path in Path(csframework.__file__).parent.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert found == []


def test_a_plugin_registered_after_the_hooks_are_built_is_called_as_pluggy_would():
    """``run.hooks.pm.register`` after the run is built: the new plugin is called (the callers are rebuilt
    when the registrations change), and one unregistered or blocked is not called any more."""
    calls = []
    pm = _manager(_Recorder("a", calls, 1))
    hooks = Hooks(pm)
    kwargs = dict(run=None, batch=None, outputs={}, batch_idx=0)
    assert hooks.on_train_batch_end(**kwargs) == [1]
    assert hooks.on_train_start(run=None) == []  # nobody implements it yet
    late = _Recorder("late", calls, 2)
    pm.register(late, name="late")
    assert hooks.on_train_batch_end(**kwargs) == [2, 1]

    class Starter:
        name = "starter"

        @csf.hookimpl
        def on_train_start(self):
            calls.append("started")

    pm.register(Starter(), name="starter")
    hooks.on_train_start(run=None)
    assert calls[-1] == "started"
    pm.unregister(name="late")
    assert hooks.on_train_batch_end(**kwargs) == [1]
    pm.set_blocked("a")
    assert hooks.on_train_batch_end(**kwargs) == []


def test_a_failing_implementation_registered_later_is_named():
    pm = _manager()
    hooks = Hooks(pm)
    hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=0)

    class Broken:
        name = "late_broken"

        @csf.hookimpl
        def on_train_batch_end(self):
            raise KeyError("x")

    pm.register(Broken(), name="late_broken")
    with pytest.raises(PluginError, match="plugin 'late_broken' in hook 'on_train_batch_end' failed"):
        hooks.on_train_batch_end(run=None, batch=None, outputs={}, batch_idx=0)


def test_quiet_names_the_hooks_nobody_implements_until_the_registrations_change():
    """``Hooks.quiet``: the hooks a loop may skip, with the generation they hold for; a registration moves the
    generation, and a traced manager names none (pluggy records every call, implemented or not)."""
    pm = _manager(_Recorder("a", []))
    hooks = Hooks(pm)
    generation, quiet = hooks.quiet()
    assert "on_train_batch_start" in quiet and "on_train_batch_end" not in quiet
    pm.register(types.SimpleNamespace(name="s", on_train_batch_start=csf.hookimpl(lambda batch_idx: None)), name="s")
    assert pm.generation != generation
    assert "on_train_batch_start" not in hooks.quiet()[1]
    pm.enable_tracing()
    assert hooks.quiet() == (None, frozenset())


def run_registering_at_step_3(late, tmp_path) -> csf.Run:
    """A 6-step run (logging every 3) whose plugin registers ``late`` in ``on_train_step_end`` of step 3,
    in the middle of the epoch."""
    import fixtures

    class Registers:
        name = "registers"

        @csf.hookimpl
        def on_train_step_end(self, run, step):
            if step == 3:
                run.hooks.pm.register(late, name="late")

    return csf.Run(fixtures.compose("loop.max_steps=6", "loop.log_every=3"), plugins=[Registers()],
                   output_dir=tmp_path)


def test_the_loop_skips_hooks_nobody_implements_and_calls_one_registered_mid_epoch(tmp_path):
    """The loop does not call a hook without implementations at each step; a plugin registered during the
    epoch (here in ``on_train_step_end`` of step 3) is called from the next batch on."""
    started: list[int] = []

    class Late:
        name = "late"

        @csf.hookimpl
        def on_train_batch_start(self, batch_idx):
            started.append(batch_idx)

    run = run_registering_at_step_3(Late(), tmp_path)
    called: list[int] = []
    through = run.hooks.on_train_batch_start

    def counting(**kwargs):
        called.append(kwargs["batch_idx"])
        return through(**kwargs)

    run.hooks.on_train_batch_start = counting
    run.fit()
    assert called == [3, 4, 5], "skipped while nobody implemented it, called once a plugin did"
    assert started == [3, 4, 5]


def test_the_step_skips_its_hooks_nobody_implements_and_calls_one_registered_mid_epoch(tmp_path):
    """The step's own hooks (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``) are
    not called while nobody implements them (``RunState.quiet``, set by the loop during an epoch); a plugin
    registered during the epoch (in ``on_train_step_end`` of step 3) is called from the next batch on."""
    seen: list[int] = []

    class Late:
        name = "late"

        @csf.hookimpl
        def on_before_backward(self, run):
            seen.append(run.micro_step)

    run = run_registering_at_step_3(Late(), tmp_path)
    called: dict[str, list[int]] = {}
    for name in ("on_before_backward", "on_after_backward", "on_before_optimizer_step"):
        def counting(_through=getattr(run.hooks, name), _name=name, **kwargs):
            called.setdefault(_name, []).append(kwargs["run"].micro_step)
            return _through(**kwargs)
        setattr(run.hooks, name, counting)
    run.fit()
    assert called == {"on_before_backward": [4, 5, 6]}, "skipped while nobody implemented them"
    assert seen == [4, 5, 6] and run.state.quiet == frozenset(), "outside an epoch every hook is called"

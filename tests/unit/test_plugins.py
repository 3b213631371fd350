"""The plugin manager: the caller hands it the built-ins; pluggy loads entry points and blocks disabled
plugins (a disabled plugin is never imported); errors name the plugin."""
import pytest

import csframework as csf
from csframework.backends.csx.plugin import CsxPlugin
from csframework.backends.eager import EagerPlugin
from csframework.errors import ConfigError, PluginError
from csframework.plugins import Hooks, backend_specs, build_manager


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

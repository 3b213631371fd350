"""Named backends (``csframework_named_backends``): ``backend=<name>`` picks a second backend of a device
type, beside the type's own backend (as ``backend=cerebras`` runs CSX beside the emulator)."""
import pytest

import csframework as csf
from csframework.errors import ConfigError

from twin_backend import plugin as twin

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

"""Schemas of the ``device`` group and of what every backend's settings share.

``device`` only picks the device type; ``backend`` holds that type's settings, typed by the schema of the
backend plugin that supplies the type (``BackendSpec.schema``): composition merges the ``backend`` node onto
it (``to_run_config``), so the core knows no backend's settings.
"""
from __future__ import annotations

from dataclasses import dataclass

from .readonly import ReadOnly


@dataclass
class DeviceConfig(ReadOnly):
    type: str = "CPU"
    """Device type: ``CPU``, ``GPU`` (CUDA), ``CSX`` (the Cerebras emulator) or a backend plugin's type.
    Chosen with ``device=cpu|gpu|csx|...``."""


@dataclass
class BackendConfig(ReadOnly):
    """What every backend schema has (a backend's schema need not derive from it, only have ``type``)."""
    type: str = "CPU"
    """The backend's device type; must agree with ``device.type``."""

"""Schemas of the ``device`` group and of what every backend's settings share.

``device`` only picks the device type; ``backend`` holds that type's settings, typed by the schema of the
backend plugin that supplies the type (``BackendSpec.schema``): composition merges the ``backend`` node onto
it (``to_run_config``), so the core knows no backend's settings.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

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


def backend_settings_help(schemas: Mapping[str, type], named: Mapping[str, tuple[str, type]]) -> str:
    """``--help``'s list of every backend's settings (the ``Config`` section shows only this device's): one line
    per device type and named backend. On another device such a key is accepted as ``null`` or its default."""
    lines = ["== Backend settings of every device (backend.<key>=...) ==",
             "A key of another device's backend is accepted as null or its default, so a config moves between devices.",
             ""]
    for label, schema in [*((f"device={t.lower()}", s) for t, s in schemas.items()),
                          *((f"backend={n}", s) for n, (_, s) in named.items())]:
        lines.append(f"{label}: {', '.join(f.name for f in fields(schema) if f.name != 'type')}")
    return "\n".join(lines)

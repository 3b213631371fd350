"""Backends execute a run's steps on one device type: eager CPU/GPU here, the CSX emulator in ``csx/``."""
from __future__ import annotations


def build_backend(run):
    """The backend for ``run.config.device.type`` (settings from the current stage's ``backend``)."""
    kind = run.stage_config.device.type
    if kind == "CSX":
        from .csx import CsxBackend

        return CsxBackend(run)
    from .eager import EagerBackend

    return EagerBackend(run)

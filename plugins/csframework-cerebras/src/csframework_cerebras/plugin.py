"""The ``cerebras`` plugin: the named backend ``backend=cerebras`` (device type CSX) and the ``cerebras``
config section, on csframework's public hooks."""
from __future__ import annotations

import csframework as csf
from csframework.backends.base import BackendSpec

from .config import CerebrasBackendConfig, CerebrasConfig, rules


def _create(run):
    from .backend import CerebrasBackend  # imports cstorch: only when a run chooses backend=cerebras

    return CerebrasBackend(run)


SPEC = BackendSpec("CSX", CerebrasBackendConfig, _create, config_path="pkg://csframework_cerebras.conf",
                   name="cerebras")


class CerebrasPlugin:
    name = "cerebras"

    @csf.hookimpl
    def csframework_named_backends(self) -> list[BackendSpec]:
        return [SPEC]

    @csf.hookimpl
    def csframework_config_sections(self) -> dict[str, type]:
        return {"cerebras": CerebrasConfig}

    @csf.hookimpl
    def on_fit_start(self, run):
        """Say what the backend found when it was built (before the run's log was open)."""
        from .backend import CerebrasBackend  # no cstorch import: the backend module imports it when built

        if isinstance(run.backend, CerebrasBackend):
            for event, fields in run.backend.warnings:
                run.log.warning(event, **fields)

    @csf.hookimpl
    def csframework_validate(self, config) -> list[str]:
        return rules(config) if isinstance(config.backend, CerebrasBackendConfig) else []

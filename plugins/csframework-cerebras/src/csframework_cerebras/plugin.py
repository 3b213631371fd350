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
    def csframework_validate(self, config) -> list[str]:
        return rules(config) if isinstance(config.backend, CerebrasBackendConfig) else []

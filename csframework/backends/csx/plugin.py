"""The built-in ``csx`` plugin: supplies the CSX backend through the same hooks a third-party backend
package uses (its schema, its validation rules and its config files). Importing it does not import the
tracer: the backend is built only when a run's device is CSX."""
from __future__ import annotations

from ...config import stage_configs, for_each_stage
from ...hookspecs import hookimpl
from ..base import BackendSpec
from .schema import CsxConfig, across_stages, stage_rules


def _create(run):
    from .backend import CsxBackend

    return CsxBackend(run)


class CsxPlugin:
    name = "csx"
    spec = BackendSpec("CSX", CsxConfig, _create, config_path="pkg://csframework.backends.csx.conf")

    @hookimpl
    def csframework_device_types(self) -> list[str]:
        return ["CSX"]

    @hookimpl(trylast=True)  # asked after every other plugin: a package may replace it
    def csframework_backend(self, device_type: str) -> BackendSpec | None:
        return self.spec if device_type == "CSX" else None

    @hookimpl
    def csframework_validate(self, config) -> list[str]:
        return for_each_stage(config, stage_rules) + across_stages(config, stage_configs(config))

"""The built-in plugins. They use only the public hooks and ``Run`` attributes, as any plugin could."""
from __future__ import annotations


def builtin_plugins() -> list[tuple[str, object]]:
    """Fresh instances, in registration order (pluggy calls the last registered first): the features
    (validation, checkpoint, metrics, eval_metrics, progress, logging) and the backends (eager CPU/GPU, CSX)."""
    from ..backends.eager import EagerPlugin
    from . import validation
    from .checkpoint import CheckpointPlugin
    from .eval_metrics import EvalMetricsPlugin
    from .logs import LoggingPlugin
    from .metrics import MetricsPlugin
    from .progress import ProgressPlugin

    return [("validation", validation), ("checkpoint", CheckpointPlugin()), ("metrics", MetricsPlugin()),
            ("eval_metrics", EvalMetricsPlugin()), ("progress", ProgressPlugin()), ("logging", LoggingPlugin()),
            ("eager", EagerPlugin()),
            ("csx", "csframework.backends.csx.plugin:CsxPlugin")]  # imported only when not disabled

"""The CLI: ``python -m csframework [group=option ...] [key=value ...]`` (Hydra overrides, ``-m`` sweeps).

Errors csframework raises on purpose (bad config, a rejected run, a failing plugin, a tracing error) are
printed without a traceback, one line per problem, with the exit status of the error (2 for config and
validation errors); ``debug=true`` shows the traceback.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from .config import explicit_groups, register_schemas, to_run_config
from .errors import CsfError

EXIT_INTERRUPTED = 130


def report_error(error: CsfError) -> None:
    sys.stderr.write(f"csframework: error: {error}\n")
    sys.stderr.flush()


def run_job(cfg: DictConfig, overrides: list[str]) -> float | None:
    """Compose, validate, build and run one job; returns the final validation loss for sweepers."""
    from .run import Run

    config = to_run_config(cfg, explicit_groups(overrides))
    run = Run(config)
    mode = config.mode.value
    if mode == "check":
        result = run.check()
        print(f"csframework: check passed: device {result['device_type']}, stages {', '.join(result['stages'])}")
        return None
    metrics = run.validate() if mode == "validate" else run.fit()["metrics"]
    return metrics.get("val/loss", metrics.get("train/loss"))


@hydra.main(version_base="1.3", config_path="pkg://csframework.conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    debug = bool(cfg.get("debug", False))
    try:
        return run_job(cfg, list(HydraConfig.get().overrides.task))
    except CsfError as e:
        if debug:
            raise
        report_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("csframework: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)


def main() -> None:
    """Entry point of ``python -m csframework`` and the ``csframework`` console script."""
    from .plugins import register_configs_from_entry_points

    register_schemas()
    try:
        register_configs_from_entry_points()
    except CsfError as e:
        report_error(e)
        sys.exit(e.exit_code)
    hydra_main()


if __name__ == "__main__":
    main()

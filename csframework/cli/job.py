"""The one task function of the CLI's ``@hydra.main`` (``task``): a single run (``single_job``), or a job of a
sweep (``csframework.sweep.run_sweep_job``), each ``run_job``: the config Hydra composed, typed once, built
into a ``Run`` and run in the mode it asks for."""
from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, cast

from omegaconf import DictConfig, OmegaConf

from .. import api, failures, hydra_session
from ..config import explicit_groups
from ..errors import CsfError, ExitCode, printable
from ..plugins import hookimpl
from .report import interrupted_line, report_error


class HydraRecord:
    """Writes what Hydra writes into ``.hydra/`` (the composed config, Hydra's config, the overrides) when
    the run starts writing, under the run directory's lock: ``conf/config.yaml`` sets
    ``hydra.output_subdir: null`` so that Hydra itself writes nothing for a run that is then refused."""

    name = "hydra_record"

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
        if run.rank != 0 or hydra_cfg.output_subdir is not None:  # the user asked Hydra to write it: done
            return
        record = run.files.sub(".hydra")  # a real directory of the run's, each file replaced atomically
        for name, node in (("config.yaml", self.cfg), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                           ("overrides.yaml", hydra_cfg.overrides.task)):
            record.write(name, OmegaConf.to_yaml(node), durable=False)


def task(found: api.Composition) -> Callable[[DictConfig], float | None]:
    """The task function: ``found``, the plugins the command line chooses (built ``for_run``), serve a
    single run whose config chooses the same; a sweep's job asks its own."""
    def csframework_task(cfg: DictConfig) -> float | None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a job of a sweep: fails alone, never exits
            from ..sweep import run_sweep_job

            return run_sweep_job(cfg, run_job)
        return single_job(cfg, job_overrides(HydraConfig.get()), found)

    return csframework_task


def job_overrides(hydra_cfg: Any) -> list[str]:
    """The job's overrides as typed on the command line (``${...}`` in them not resolved)."""
    return [str(o) for o in cast(list, OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))]


def settled(cfg: DictConfig, overrides: list[str], found: api.Composition) -> tuple[DictConfig, api.Composition]:
    """``cfg`` and the plugins it chooses: ``found`` when its ``plugins.enable`` / ``plugins.disable`` are the
    command line's; else (a config file chose others) those, and ``cfg`` composed again in this Hydra session
    (``hydra.compose``) now that their config sections are known."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    choices = hydra_session.plugin_choices(cfg)
    if choices == (found.enabled, found.disabled):
        return cfg, found
    found = api.composition((), *choices, for_run=True)
    with hydra_session.composition_errors():
        return compose(HydraConfig.get().job.config_name, overrides), found


def run_job(cfg: DictConfig, overrides: list[str], found: api.Composition | None = None) -> float | None:
    """Type ``cfg`` once, build and run its ``Run`` (with ``found``'s plugins when they are the config's, see
    ``settled``; a sweep's job asks its own); returns the final validation loss for sweepers."""
    from ..run import Run

    if found is None:
        found = api.config_composition(cfg, for_run=True)
    else:
        cfg, found = settled(cfg, overrides, found)
    config = api.typed(found, cfg, explicit_groups(overrides))
    run = Run(config, plugins=[HydraRecord(cfg)], manager=found.run_manager(config))
    mode = config.mode.value
    if mode == "check":
        result = run.check()
        print(f"csframework: check passed: device {result['device_type']}, stages {', '.join(result['stages'])}")
        return None
    try:
        summary = {"validate": run.validate, "test": run.test, "predict": run.predict}.get(mode, run.fit)()
    except Exception as e:  # the user's code failed the run: one line (failures.py), its traceback in error.txt
        if not failures.is_user_failure(e):
            raise
        raise failures.run_failed(run, e, run.error_file) from e
    if run.already_complete:
        stopped = f" (stopped early: {printable(run.stop_reason)})" if run.stop_reason else ""
        print(f"csframework: already complete at step {run.global_step}{stopped}; nothing to do")
    metrics = summary["metrics"]
    return metrics.get("val/loss", metrics.get("train/loss"))


def single_job(cfg: DictConfig, overrides: list[str], found: api.Composition) -> float | None:
    """``run_job`` for a run that is not part of a sweep: an error csframework raises on purpose is reported
    in one line and ends the process with its status; with ``debug=true``, and for any other error, the
    traceback and ``ExitCode.FAILED`` (never through Hydra's job report, which would add its own line)."""
    debug = bool(cfg.get("debug", False))
    try:
        return run_job(cfg, overrides, found)
    except CsfError as e:
        if not debug:
            report_error(e)
            sys.exit(e.exit_code)
        traceback.print_exc()
        sys.exit(ExitCode.FAILED)
    except KeyboardInterrupt as e:  # signals.Interrupted carries the signal's status (130 / 143)
        sys.stderr.write(printable(interrupted_line(e)) + "\n")
        sys.exit(getattr(e, "exit_code", ExitCode.INTERRUPTED))
    except Exception:  # noqa: BLE001 - csframework's own failure: the traceback, as Python prints it
        traceback.print_exc()
        sys.exit(ExitCode.FAILED)

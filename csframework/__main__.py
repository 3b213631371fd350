"""The CLI: ``python -m csframework [group=option ...] [key=value ...]`` (Hydra overrides, ``-m`` sweeps).

Errors csframework raises on purpose (bad config, a rejected run, a failing plugin, a tracing error) are
printed without a traceback, one line per problem, with the exit status of the error (2 for config and
validation errors); ``debug=true`` shows the traceback. Before Hydra starts a single run, the overrides
are composed once here, so a composition error (unknown key, wrong type, missing group option, a broken
YAML file, an unparsable override) is one line naming the key or file too.

Exit status: 0 done; 1 a run that failed (a plugin, a non-finite loss, a tracing error); 2 a bad config, a
rejected run or a plugin whose hooks match no hook (nothing trained, no checkpoint); 130 stopped by SIGINT
and 143 by SIGTERM (128 + the signal number: the step finished, a checkpoint was saved and
``summary.json`` says ``interrupted``). A multirun (``-m``) exits 0 when every job completed, 1 when any
failed and 130/143 when stopped; a failing job fails alone (``csframework.sweep``, docs/sweeps.md).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

import hydra
from omegaconf import DictConfig

from . import api
from .config import explicit_groups
from .errors import CsfError, ValidationError, one_line

EXIT_INTERRUPTED = 130


def error_lines(error: CsfError) -> list[str]:
    """The report of ``error``, one line per problem: ``csframework: error: <message>``, or for a run the
    validation rejected on several counts, ``csframework: error: invalid run:`` then ``  - <problem>``."""
    if isinstance(error, ValidationError) and len(error.problems) > 1:
        return ["csframework: error: invalid run:"] + [f"  - {one_line(p)}" for p in error.problems]
    if isinstance(error, ValidationError) and error.problems:
        return [f"csframework: error: invalid run: {one_line(error.problems[0])}"]
    return [f"csframework: error: {one_line(str(error)) or type(error).__name__}"]


def report_error(error: CsfError) -> None:
    sys.stderr.write("".join(line + "\n" for line in error_lines(error)))
    sys.stderr.flush()


def precompose(argv: list[str]) -> None:
    """Compose a single run's config from the command line as Hydra will, raising ``ConfigError`` (one
    line naming the key or file) if it does not compose. Multirun, help and info modes are left to Hydra,
    once the user's config files are checked (``check_config_files``)."""
    from hydra._internal.utils import get_args_parser

    from .config import check_config_files, user_config_dirs

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except SystemExit:  # a usage error, or --version: Hydra reports it
        return
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.multirun
            or args.experimental_rerun or args.config_path or args.resolve
            or any(o.startswith("hydra.mode=") for o in args.overrides)):
        config_path = args.config_path if args.config_path and os.path.isabs(args.config_path) else None
        check_config_files(user_config_dirs(args.overrides, args.config_dir, config_path))
        return
    api.compose(args.overrides, config_dir=args.config_dir, config_name=args.config_name or "config")


def run_job(cfg: DictConfig, overrides: list[str]) -> float | None:
    """Compose, validate, build and run one job; returns the final validation loss for sweepers."""
    from .run import Run

    config = api.to_run_config(cfg, explicit_groups(overrides))
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
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:  # a job of a sweep: fails alone, never exits
        from .sweep import run_sweep_job

        return run_sweep_job(cfg, run_job)
    debug = bool(cfg.get("debug", False))
    try:
        return run_job(cfg, list(HydraConfig.get().overrides.task))
    except CsfError as e:
        if debug:
            raise
        report_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:  # signals.Interrupted carries the signal's status (130 / 143)
        sys.stderr.write(f"csframework: interrupted: {e}\n" if str(e) else "csframework: interrupted\n")
        sys.exit(getattr(e, "exit_code", EXIT_INTERRUPTED))


def main() -> None:
    """Entry point of ``python -m csframework`` and the ``csframework`` console script."""
    try:
        api.composition()  # the plugins' configs and the backends' config files, into Hydra's ConfigStore
        precompose(sys.argv[1:])
    except CsfError as e:
        if "debug=true" in sys.argv[1:]:
            raise
        report_error(e)
        sys.exit(e.exit_code)
    if is_multirun(sys.argv[1:]):
        from . import sweep

        sys.argv[1:] = sweep.sweeper_overrides(sys.argv[1:])
        with sweep.forward_signals():
            hydra_main()
        sys.exit(sweep.finish())
    try:
        hydra_main()
    except SystemExit as e:
        leave_process_group(e.code)
        raise
    leave_process_group(0)


def leave_process_group(status) -> None:
    """Under torchrun, end this rank here: wait for every rank at a barrier (a completed run's ranks all get
    here), destroy the process group and leave with ``os._exit``. Left to interpreter finalisation, gloo's
    threads can outlive the objects that own them and abort a completed rank ("terminate called without an
    active exception", SIGABRT), so torchrun would report a completed run as failed. Everything csframework
    writes is closed and fsynced by now; stdio and logging are flushed first."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import logging
    import os

    code = status if isinstance(status, int) else (0 if status is None else 1)
    try:
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer is gone: nothing left to agree on; leave all the same
        pass
    if isinstance(status, str):
        sys.stderr.write(status + "\n")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def is_multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in argv)


if __name__ == "__main__":
    main()

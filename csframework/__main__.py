"""The CLI: ``python -m csframework [group=option ...] [key=value ...]`` (Hydra overrides, ``-m`` sweeps).

Errors csframework raises on purpose (bad config, a rejected run, a failing plugin, a tracing error) are
printed without a traceback, one line per problem, with the exit status of the error (2 for config and
validation errors); ``debug=true`` shows the traceback. A composition error (unknown key, wrong type, missing
group option, a broken YAML file, an unparsable override) is one line naming the key or file too: a single
run's config is composed once, here, by the Hydra instance that then runs it
(``hydra_session.compose_run``, ``hydra_session.run_composed``: Hydra's own run sequence without its two
further compositions); a sweep's overrides are
composed here first (every swept value) before Hydra's ``@hydra.main`` takes over, as are help and info.

A rejected run writes nothing: Hydra writes no ``.hydra/`` (``hydra.output_subdir: null``; ``HydraRecord``
writes it once the run starts), and the run directory, resolved here and handed to Hydra, is removed again
with the parents this process created for it when nothing was written there (``mode=check``, a refused
run, a torchrun rank other than 0, which writes into rank 0's directory).

Exit status: an ``ExitCode`` (``csframework/errors.py``; the table is in docs/reference/cli.md): ``OK``,
``FAILED`` (a run failed), ``CONFIG_ERROR`` (a bad config or rejected run), ``INTERRUPTED`` or
``TERMINATED`` (stopped by SIGINT or SIGTERM). A multirun's: ``csframework.sweep``, docs/guides/sweeps.md.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple, cast

from omegaconf import DictConfig, OmegaConf

from . import api, command, failures, hydra_session
from .config import RunConfig, check_config_files, describe_error, explicit_groups, user_config_dirs
from .config.backend import backend_settings_help
from .errors import ConfigError, CsfError, ExitCode, ValidationError, clipped_words, one_line, printable
from .plugins import hookimpl
from .rundir import check_run_dir


def error_lines(error: CsfError) -> list[str]:
    """The report of ``error``, one line per problem: ``csframework: error: <message>``, or for a run the
    validation rejected on several counts, ``csframework: error: invalid run:`` then ``  - <problem>``."""
    if isinstance(error, ValidationError) and len(error.problems) > 1:
        return ["csframework: error: invalid run:"] + [f"  - {one_line(p)}" for p in error.problems]
    if isinstance(error, ValidationError) and error.problems:
        return [f"csframework: error: invalid run: {one_line(error.problems[0])}"]
    return [f"csframework: error: {one_line(str(error)) or type(error).__name__}"]


def report_error(error: CsfError) -> None:
    sys.stderr.write("".join(printable(clipped_words(line)) + "\n" for line in error_lines(error)))
    sys.stderr.flush()


def sweep_samples(overrides: list[str]) -> list[tuple[list[str], list[str]]]:
    """Jobs of a sweep that together use every value of every swept key (the first job, then one more per
    further value), as Hydra's basic sweeper spells them: ``(overrides, the swept ones among them)``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_discrete_sweep()
                   else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
                   for o in parsed if not o.is_sweep_override() or o.is_discrete_sweep()]
    except HydraException as e:
        raise ConfigError(describe_error(e)) from e
    first = [values[0] for values in choices]
    jobs = [first]
    for i, values in enumerate(choices):
        jobs += [first[:i] + [value] + first[i + 1:] for value in values[1:]]
    swept = [i for i, values in enumerate(choices) if len(values) > 1]
    return [(job, [job[i] for i in swept]) for job in jobs]


def new_directories(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_if_empty(directories: list[Path]) -> None:
    """Remove the directories this process created for a run that then wrote nothing there (a rejected
    run, ``mode=check``, a rank other than 0); ``rmdir`` refuses any directory that holds something."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


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


def run_job(cfg: DictConfig, overrides: list[str], typed: Typed | None = None) -> float | None:
    """Validate, build and run one job (``typed``: ``cfg`` already typed by the composition that asked the
    plugins, else typed here, a composition of its own); returns the final validation loss for sweepers."""
    from .run import Run

    if typed is None:
        found = api.config_composition(cfg, for_run=True)
        typed = Typed(api.typed(found, cfg, explicit_groups(overrides)), found)
    config = typed.config
    run = Run(config, plugins=[HydraRecord(cfg)], manager=typed.found.run_manager(config))
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


def hydra_task(cfg: DictConfig) -> float | None:
    """The job of ``@hydra.main`` (``hydra_main``): a sweep's job, or a run the CLI did not compose itself."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:  # a job of a sweep: fails alone, never exits
        from .sweep import run_sweep_job

        return run_sweep_job(cfg, run_job)
    return single_job(cfg, task_overrides(HydraConfig.get()))


hydra_main = hydra_session.main_app(hydra_task)


def task_overrides(hydra_cfg: Any) -> list[str]:
    """The job's overrides as typed on the command line (``${...}`` in them not resolved)."""
    return [str(o) for o in cast(list, OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))]


def single_job(cfg: DictConfig, overrides: list[str], typed: Typed | None = None) -> float | None:
    """``run_job`` for a run that is not part of a sweep: an error csframework raises on purpose is
    reported in one line and ends the process with its status (the traceback with ``debug=true``)."""
    debug = bool(cfg.get("debug", False))
    try:
        return run_job(cfg, overrides, typed)
    except CsfError as e:
        if debug:
            raise
        report_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:  # signals.Interrupted carries the signal's status (130 / 143)
        sys.stderr.write(printable(interrupted_line(e)) + "\n")
        sys.exit(getattr(e, "exit_code", ExitCode.INTERRUPTED))


def interrupted_line(error: KeyboardInterrupt) -> str:
    """What the CLI says when a run stopped on a signal: what happened and the whole command that continues
    the run (the command as typed, with ``checkpoint.resume=auto`` and this run's directory)."""
    from hydra.core.hydra_config import HydraConfig

    reason = getattr(error, "reason", None) or str(error)
    line = f"csframework: interrupted: {reason}" if reason else "csframework: interrupted"
    if HydraConfig.initialized():
        line += f"; continue with: {command.continue_command(HydraConfig.get().runtime.output_dir)}"
    return line


# -- the one dispatch ----------------------------------------------------------------------------------------
HYDRA, MULTIRUN, RUN = "hydra", "multirun", "run"


class Typed(NamedTuple):
    """A job's config typed, and the composition (the plugins) that typed it."""

    config: RunConfig
    found: api.Composition


def mode_of(args: Any) -> str:
    """What the command line asks for, chosen here only (as Hydra's ``_run_hydra`` does): ``multirun``
    (``-m``, ``hydra.mode=MULTIRUN``), ``hydra`` (help, info, ``--cfg``, shell completion, another config
    path, ``--resolve``, ``--experimental-rerun``, a usage error: left to Hydra's ``@hydra.main``, which runs
    a run it composes through ``hydra_task``) or ``run`` (one run, composed once, here)."""
    if args is None or (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
                        or args.experimental_rerun or args.config_path or args.resolve):
        return HYDRA
    swept = args.multirun or any(o.replace(" ", "") == "hydra.mode=MULTIRUN" for o in args.overrides)
    return MULTIRUN if swept else RUN


def check_sweep(args: Any, found: api.Composition) -> None:
    """Compose every value of every swept key as the jobs will (``sweep_samples``; a sweeper of the user's
    choice, Optuna's say, picks its own values and is left to itself), raising ``ConfigError`` naming the
    job, then the key or file. The first job's config files may enable plugins (``api.settled``): their
    sections count for every job, and for the jobs Hydra then composes."""
    check_config_files(user_config_dirs(args.overrides, args.config_dir))
    if any(o.lstrip("+~").startswith(("hydra/sweeper", "hydra.sweeper")) for o in args.overrides):
        return
    for index, (job, swept) in enumerate(sweep_samples(args.overrides)):
        def composed(found: api.Composition, job: list[str] = job) -> DictConfig:
            return hydra_session.compose_dict(job, args.config_dir, args.config_name or "config",
                                              sections=found.sections, disabled=found.disabled)

        try:
            if index == 0:
                found, cfg = api.settled(job, args.config_dir, args.config_name or "config", composed,
                                         hydra_session.plugin_choices, found=found)
            else:
                cfg = composed(found)
            api.typed(found, cfg, explicit_groups(job))
        except ConfigError as e:
            raise ConfigError(f"the sweep's job with {' '.join(swept)}: {e}") from e


class SingleRun(NamedTuple):
    """The command line's single run: composed by the Hydra instance that runs it, and the composition (the
    plugins) that typed it."""

    composed: hydra_session.ComposedRun
    found: api.Composition


def compose_run(args: Any) -> SingleRun | None:
    """The single run of the command line, composed once (``hydra_session.compose_run``) with the plugins
    its overrides and config files choose (``api.settled``), whose manager the run is handed; its run
    directory checked. ``None`` when the config itself asks for a sweep (``hydra.mode: MULTIRUN``)."""
    name = args.config_name or "config"

    def composed_with(found: api.Composition) -> hydra_session.ComposedRun | None:
        return hydra_session.compose_run(args.overrides, args.config_dir, name, backends=found.schemas,
                                         sections=found.sections, named=found.named, disabled=found.disabled)

    found, composed = api.settled(args.overrides, args.config_dir, name, composed_with,
                                  lambda run: hydra_session.plugin_choices(run.cfg) if run is not None else None,
                                  for_run=True)
    if composed is None:
        return None
    check_run_dir(Path(composed.run_dir))
    return SingleRun(composed, found)


def main() -> None:
    """Entry point of ``python -m csframework`` and the ``csframework`` console script: the command line is
    parsed once, what it asks for chosen once (``mode_of``), composed and checked, then run. An error
    csframework raises on purpose before anything ran is one line (the traceback with ``debug=true``)."""
    command.ARGV = list(sys.argv)  # summary.json records the command as typed; hints continue it
    args = hydra_session.parse_command_line(sys.argv[1:])
    mode, single = mode_of(args), None
    try:
        if mode == RUN:
            single = compose_run(args)
            mode = RUN if single is not None else MULTIRUN  # the config's own hydra.mode asks for a sweep
        if mode == MULTIRUN:
            check_sweep(args, api.command_line_composition(args.overrides))
        elif mode == HYDRA and args is not None:
            config_path = args.config_path if args.config_path and os.path.isabs(args.config_path) else None
            found = api.command_line_composition(args.overrides)  # the plugins' configs, for Hydra's help and --cfg
            if args.help:
                sys.argv.append(help_footer(found))
            check_config_files(user_config_dirs(args.overrides, args.config_dir, config_path))
    except CsfError as e:
        if "debug=true" in sys.argv[1:]:
            raise
        report_error(e)
        sys.exit(e.exit_code)
    if single is not None:
        finish(lambda: run_composed(single), single.composed.run_dir)
    elif mode == MULTIRUN:
        run_multirun()
    else:
        finish(hydra_main, None)


def help_footer(found: api.Composition) -> str:
    """The override that ends ``--help`` with every device's backend settings (its ``Config`` section shows
    only this device's), before Hydra's own footer."""
    text = (f"{backend_settings_help(found.schemas, found.named)}\n\nPowered by Hydra (https://hydra.cc)\n"
            "Use --hydra-help to view Hydra specific help\n")
    return "hydra.help.footer='" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_composed(single: SingleRun) -> None:
    """Run the single run the CLI composed (``compose_run``) in the Hydra instance that composed it:
    ``single_job`` with the typed config and the composition's plugins, the overrides as typed (``${...}``
    in them not resolved)."""
    composed = single.composed
    overrides = task_overrides(composed.cfg.hydra)
    typed = Typed(composed.config, single.found)

    def task(task_cfg: DictConfig) -> float | None:
        return single_job(task_cfg, overrides, typed)

    hydra_session.run_composed(composed, task)


def run_multirun() -> None:
    """A sweep: Hydra's ``@hydra.main`` runs the jobs (``hydra_task``); then the sweep's table, plot and
    exit status (``csframework.sweep``)."""
    from . import sweep

    sys.argv[1:] = sweep.sweeper_overrides(sys.argv[1:])
    with sweep.forward_signals(), contextlib.suppress(sweep.SweepEnded):  # a worker died: rows written
        hydra_main()
    sys.exit(sweep.finish())


def finish(run, run_dir: Path | str | None) -> None:
    """Call ``run`` (the rest of the process's work), then remove the directories it created in vain for
    ``run_dir`` and, under torchrun, leave the process group (``leave_process_group``)."""
    created = new_directories(Path(run_dir)) if run_dir is not None else []
    try:
        try:
            run()
        finally:
            remove_if_empty(created)
    except SystemExit as e:
        leave_process_group(e.code)
        raise
    leave_process_group(ExitCode.OK)


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

    code = status if isinstance(status, int) else ExitCode.OK if status is None else ExitCode.FAILED
    try:
        if code == ExitCode.OK:
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


if __name__ == "__main__":
    main()

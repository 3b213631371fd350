"""The CLI: ``python -m csframework [group=option ...] [key=value ...]`` (``-m`` for a sweep).

Hydra's ``@hydra.main`` on csframework's configs with one task function (``cli.job.task``): Hydra's own
dispatch chooses a run, a sweep, ``--help``, ``--cfg`` or ``--info``. Here, before it: the plugins the
overrides choose (their config sections, backends and configs registered), and the user's config files
checked before Hydra reads them. An error csframework raises on purpose, or Hydra raises composing
(``HYDRA_FULL_ERROR`` makes it raise), is one line with its ``ExitCode`` (``debug=true``: the traceback).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import api, command, hydra_session
from .cli.job import task
from .cli.process_group import leave_process_group
from .cli.report import error_lines, report_error  # noqa: F401 - the CLI's report, as tests and docs name it
from .cli.run_dir import CREATED, remove_if_empty, undo_refused
from .config import check_config_files, user_config_dirs
from .config.backend import backend_settings_help
from .errors import ConfigError, CsfError, ExitCode
from .multirun import SweepEnded, multirun_started, sweeper_overrides


def command_line(argv: list[str]) -> argparse.Namespace:
    """What csframework reads of the command line before Hydra does: the config directory and name (the
    user's config files are checked before Hydra reads them), ``--help`` and the overrides (those that
    choose plugins or a config file). Hydra parses the whole command line itself."""
    def flag(long: str, short: str) -> str | None:
        for i, item in enumerate(argv):
            if item in (long, short) and i + 1 < len(argv):
                return argv[i + 1]
            if item.startswith(long + "="):
                return item[len(long) + 1:]
        return None

    config_path = flag("--config-path", "-cp")
    return argparse.Namespace(
        help="--help" in argv or "-h" in argv, config_dir=flag("--config-dir", "-cd"),
        config_name=flag("--config-name", "-cn"),
        config_path=config_path if config_path and os.path.isabs(config_path) else None,  # else csframework's
        overrides=[a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))])


def main() -> None:
    """Entry point of ``python -m csframework`` and the ``csframework`` console script."""
    command.ARGV = list(sys.argv)  # summary.json records the command as typed; hints continue it
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it cannot compose: reported here, in one line
    sys.argv[1:] = sweeper_overrides(sys.argv[1:])
    args = command_line(sys.argv[1:])
    try:
        try:
            found = api.command_line_composition(args.overrides, for_run=True)
            hydra_session.check_disabled_sections(args.overrides, found.sections, found.disabled)
            check_config_files(user_config_dirs(args.overrides, args.config_dir, args.config_path))
            if args.help:
                add_override(sys.argv, help_footer(found))
            finish(lambda: run_hydra(args, found))
        except hydra_session.CallbackError as e:  # refused in a Hydra callback (run directory, sweep values)
            raise e.error from e
    except CsfError as e:
        if "debug=true" in sys.argv[1:]:
            raise
        report_error(e)
        sys.exit(e.exit_code)


def run_hydra(args: argparse.Namespace, found: api.Composition) -> None:
    """Hydra's ``@hydra.main`` with the task function; then, for a sweep, its table, plot and exit status
    (``csframework.sweep.finish``). Where the config does not compose because a config file enables a plugin
    and sets its section, the plugins the config files choose are asked, and Hydra runs once more."""
    for attempt in (1, 2):
        try:
            with hydra_session.composition_errors(args.overrides):
                hydra_session.main_app(task(found))()
            break
        except SweepEnded:  # a joblib worker died: every job of its batch has its row
            break
        except ConfigError as e:
            missing = getattr(e.__cause__, "missing_cfg_file", None)
            if missing is not None and missing == (args.config_name or "config"):
                raise ConfigError(hydra_session.missing_primary(missing, args.config_dir)) from e
            chosen = hydra_session.plugins_of_config_files(args.overrides, args.config_dir,
                                                           args.config_name or "config", found.sections)
            if attempt == 2 or chosen is None or chosen == (found.enabled, found.disabled):
                raise
            found = api.composition((), *chosen, for_run=True)
    if multirun_started():
        from .sweep import finish as finish_sweep

        sys.exit(finish_sweep())


def add_override(argv: list[str], override: str) -> None:
    """Put ``override`` among ``argv``'s overrides (before the first, or last when there is none): Hydra's
    parser takes the overrides as one run of words, so one appended after a flag (``device=csx --help``) would
    be an unrecognized argument."""
    first = next((i for i, arg in enumerate(argv[1:], 1) if not arg.startswith("-")
                  and ("=" in arg or arg.startswith("~")) and argv[i - 1] not in FLAGS_WITH_VALUES), len(argv))
    argv.insert(first, override)


#: Hydra's flags that take the next word as their value (which is no override, even with an ``=`` in it)
FLAGS_WITH_VALUES = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--cfg", "-c",
                     "--package", "-p", "--info", "-i", "--experimental-rerun")


def help_footer(found: api.Composition) -> str:
    """The override that ends ``--help`` with every device's backend settings (its ``Config`` section shows
    only this device's), before Hydra's own footer."""
    text = (f"{backend_settings_help(found.schemas, found.named)}\n\nPowered by Hydra (https://hydra.cc)\n"
            "Use --hydra-help to view Hydra specific help\n")
    return "hydra.help.footer='" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def finish(run) -> None:
    """Call ``run`` (the rest of the process's work), then remove the directories Hydra created in vain for a
    single run (``cli.run_dir``) and, under torchrun, leave the process group (``leave_process_group``)."""
    try:
        try:
            run()
        except SystemExit as e:
            if e.code == ExitCode.CONFIG_ERROR:  # refused: nothing trained, Hydra's .hydra/ record undone
                undo_refused()
            raise
        finally:
            remove_if_empty(list(CREATED))
    except SystemExit as e:
        leave_process_group(e.code)
        raise
    leave_process_group(ExitCode.OK)


if __name__ == "__main__":
    main()

"""The command that started this process (``summary.json``'s ``command_line``), and the command that
continues a run (every "continue with" hint): the same command line with ``checkpoint.resume=auto`` and the
run's directory, so that it resumes that run rather than starting a new one in a new dated directory."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

#: The command line as typed; the CLI sets it before it adds overrides of its own (``hydra.run.dir``).
ARGV: list[str] | None = None

#: Overrides a continuing command sets itself (or must not repeat: ``start_over`` would move the run aside).
_REPLACED = ("checkpoint.resume", "checkpoint.start_over", "hydra.run.dir", "hydra.sweep.dir")


def command_line() -> str:
    """The command that started this process, as a shell would take it (``python -m csframework ...`` for
    the CLI, also under torchrun)."""
    return spelled(ARGV if ARGV is not None else sys.argv)


def spelled(argv: list[str]) -> str:
    """``argv`` as a shell would take it, the CLI's program as ``python -m csframework``."""
    program = argv[0] if argv else ""
    if Path(program).name == "__main__.py" and Path(program).parent.name == "csframework":
        program = "python -m csframework"
    elif program.endswith(".py"):
        program = f"python {shlex.quote(program)}"
    else:
        program = shlex.quote(program)
    return " ".join([program, *map(shlex.quote, argv[1:])])


def continue_run(run_dir: str | Path) -> str:
    """``continue_command`` of the run in ``run_dir``; for a job of a multirun, of its sweep (rerun whole:
    its finished jobs are skipped, the others resume)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return continue_command(HydraConfig.get().sweep.dir, sweep=True)
    return continue_command(run_dir)


def continue_command(directory: str | Path, sweep: bool = False) -> str:
    """The command line that continues the run in ``directory`` (with ``sweep``: the sweep in it): the
    command as typed, its own ``checkpoint.resume``/``start_over`` and run (sweep) directory replaced by
    ``checkpoint.resume=auto hydra.run.dir=<directory>`` (``hydra.sweep.dir``). Outside the CLI (``Run.fit``
    in a script), the settings to give that run."""
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    added = ["checkpoint.resume=auto", f"{key}={Path(directory).absolute()}"]
    if ARGV is None:
        return f"checkpoint.resume=auto and output directory {Path(directory).absolute()}"
    kept = [a for a in ARGV[1:] if a.lstrip("+~").split("=", 1)[0] not in _REPLACED]
    return spelled([ARGV[0], *kept, *added])


"""Test fixtures for plugin authors: a pytest plugin, registered under the ``pytest11`` entry point, so
every test in an environment where csframework is installed gets them with no import.

- ``csf_runner``: ``csf_runner.run(overrides=[...], plugins=[...])`` fits a tiny built-in model
  (``model=tiny_linear data=tiny_clusters``, 20 steps, evaluation every 5) in a temporary run directory
  and returns a :class:`RunResult`; a failing run does not raise. ``csf_runner.cli([...])`` runs the same
  through ``python -m csframework`` in a subprocess (for ``-m`` sweeps, signals, exit statuses).
- ``csf_hook_recorder``: a plugin instance whose ``.calls`` lists ``(hook_name, argument_names)`` of
  every hook call, in order.

Entry-point plugins load as installed; ``autoload=["name", ...]`` limits a run to those (through
``CSFRAMEWORK_PLUGINS_AUTOLOAD``), so a plugin's tests do not depend on what else is installed.
This module imports only pytest at load time: collecting tests stays fast.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pytest

#: What ``csf_runner`` trains: a linear classifier on 128 points, 20 SGD steps, evaluation every 5 steps.
TINY_RUN = ["model=tiny_linear", "data=tiny_clusters", "optimizer=sgd", "optimizer.lr=0.1",
            "loop.max_steps=20", "loop.eval_every=5", "loop.eval_steps=null", "loop.log_every=5"]


@dataclass
class RunResult:
    """What a run left: ``exit_code`` (as the CLI's, a ``csf.ExitCode`` when csframework decided it: ``OK``,
    ``FAILED``, ``CONFIG_ERROR``, ``INTERRUPTED``/``TERMINATED``), ``output_dir``, ``summary``
    (``summary.json``; ``{}`` if none), ``events`` (``events.jsonl`` records), ``metrics`` (``metrics.csv``
    rows: ``step`` int, ``stage``, ``name``, ``value`` float), ``error`` (the exception of an in-process run)
    and, for ``cli``, ``stdout``/``stderr``."""

    exit_code: int
    output_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    stdout: str = ""
    stderr: str = ""

    def series(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` of metric ``name``, in the order logged."""
        return [(row["step"], row["value"]) for row in self.metrics if row["name"] == name]

    @classmethod
    def read(cls, exit_code: int, output_dir: Path, **extra: Any) -> RunResult:
        output_dir = Path(output_dir)
        summary: dict[str, Any] = {}
        events: list[dict[str, Any]] = []
        metrics: list[dict[str, Any]] = []
        with contextlib.suppress(OSError, ValueError):
            summary = json.loads((output_dir / "summary.json").read_text(encoding="utf-8"))
        with contextlib.suppress(OSError):
            events = [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines() if line]
        with contextlib.suppress(OSError):
            with open(output_dir / "metrics.csv", newline="", encoding="utf-8") as f:
                metrics = [dict(row, step=int(row["step"]), value=float(row["value"])) for row in csv.DictReader(f)]
        return cls(exit_code, output_dir, summary, events, metrics, **extra)


def _set_env(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def _env(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (``None``: unset) while active."""
    saved = {key: os.environ.get(key) for key in changes}
    _set_env(changes)
    try:
        yield
    finally:
        _set_env(saved)


def _autoload_env(autoload: Iterable[str] | None) -> dict[str, str]:
    from .plugins import AUTOLOAD_ENV

    return {} if autoload is None else {AUTOLOAD_ENV: ",".join(autoload) or "0"}


class CsfRunner:
    """Runs tiny fits in run directories under ``root`` (``run-1``, ``run-2`` ... unless given)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.count = 0

    def _dir(self, output_dir: str | Path | None) -> Path:
        if output_dir is not None:
            return Path(output_dir)
        self.count += 1
        return self.root / f"run-{self.count}"

    def run(self, overrides: Sequence[str] = (), plugins: Iterable[Any] = (), output_dir: str | Path | None = None,
            autoload: Iterable[str] | None = None, config_dir: str | None = None) -> RunResult:
        """Compose ``TINY_RUN + overrides`` (plugin sections included) and run it in this process as
        ``mode`` says (``fit`` by default) with ``plugins`` added; errors become ``exit_code``/``error``.
        Pass the same ``output_dir`` again with ``checkpoint.resume=auto`` to continue a run."""
        import csframework as csf
        from .signals import exit_status

        output_dir = self._dir(output_dir)
        error: BaseException | None = None
        code = csf.ExitCode.OK
        with _env(_autoload_env(autoload)):
            try:
                config = csf.compose([*TINY_RUN, *overrides], config_dir=config_dir)
                run = csf.Run(config, plugins=list(plugins), output_dir=output_dir)
                mode = config.mode.value
                returned = {"check": run.check, "validate": run.validate, "test": run.test,
                            "predict": run.predict}.get(mode, run.fit)()
                result = RunResult.read(csf.ExitCode.OK, output_dir)
                result.summary = result.summary or returned  # mode=check, or the metrics plugin disabled
                return result
            except csf.CsfError as e:
                error, code = e, e.exit_code
            except KeyboardInterrupt as e:  # csf.Interrupted: a stop signal; 130/143 as the CLI
                error, code = e, getattr(e, "exit_code", exit_status(None))
            except Exception as e:  # noqa: BLE001 - reported, not raised: tests assert on the result
                error, code = e, csf.ExitCode.FAILED
        return RunResult.read(code, output_dir, error=error)

    def cli(self, args: Sequence[str] = (), output_dir: str | Path | None = None, autoload: Iterable[str] | None = None,
            env: dict[str, str] | None = None, nproc: int = 1, timeout: float = 300) -> RunResult:
        """``python -m csframework TINY_RUN + args`` in a subprocess, in ``output_dir`` (with ``-m``, the
        sweep directory: one numbered job directory each). ``nproc > 1``: under ``torchrun`` with that many
        ranks and ``backend.strategy=ddp``."""
        output_dir = self._dir(output_dir)
        launch = [sys.executable]
        if nproc > 1:
            launch += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
            args = [*args, "backend.strategy=ddp"]
        where = "hydra.sweep.dir" if {"-m", "--multirun"} & set(args) else "hydra.run.dir"
        full_env = dict(os.environ, **(env or {}))
        for key, value in _autoload_env(autoload).items():
            full_env[key] = value
        options, overrides = _split_options(args)
        done = subprocess.run([*launch, "-m", "csframework", *options, *TINY_RUN, *overrides,
                               f"{where}={output_dir}"],
                              env=full_env, capture_output=True, text=True, timeout=timeout)
        return RunResult.read(done.returncode, output_dir, stdout=done.stdout, stderr=done.stderr)


_VALUED_OPTIONS = {"--config-dir", "-cd", "--config-name", "-cn", "--cfg", "-c", "--package", "-p",
                   "--config-path", "-cp", "--info", "-i"}


def _split_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line options (``-m``, ``--config-dir DIR`` ...) and overrides: Hydra wants options first."""
    options, overrides, args = [], [], list(args)
    while args:
        arg = args.pop(0)
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        options.append(arg)
        if arg in _VALUED_OPTIONS and args and "=" not in arg:
            options.append(args.pop(0))
    return options, overrides


class HookRecorder:
    """A plugin that records every hook call: ``calls`` is ``[(hook_name, argument_names), ...]`` in call
    order (``argument_names`` as the hook spec lists them). The hooks asked before composition
    (``csframework_register_configs``, ``csframework_config_sections``) are not recorded."""

    name = "csf_hook_recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def names(self) -> list[str]:
        """The hook names of ``calls``."""
        return [hook for hook, _ in self.calls]


def _add_recording_hooks() -> None:
    import inspect

    from . import hookspecs
    from .plugins import COMPOSITION_HOOKS, hookimpl

    for hook, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        if not hasattr(spec, "csframework_spec") or hook in COMPOSITION_HOOKS:
            continue
        args = tuple(inspect.signature(spec).parameters)
        # pluggy passes a hook implementation the arguments its code names, so each one is real code
        source = f"def {hook}(self, {', '.join(args)}):\n    self.calls.append(({hook!r}, {args!r}))\n"
        namespace: dict[str, Any] = {}
        exec(source, namespace)  # noqa: S102 - built from the hook specs only
        setattr(HookRecorder, hook, hookimpl(namespace[hook]))


@pytest.fixture
def csf_runner(tmp_path: Path) -> CsfRunner:
    """Runs a tiny fit: ``csf_runner.run(overrides=[...], plugins=[...])`` -> ``RunResult``."""
    return CsfRunner(tmp_path / "csf-runs")


@pytest.fixture
def csf_hook_recorder() -> HookRecorder:
    """A fresh ``HookRecorder``: pass it in ``plugins=[...]``, then read ``.calls``."""
    if not hasattr(HookRecorder, "on_fit_start"):
        _add_recording_hooks()
    return HookRecorder()

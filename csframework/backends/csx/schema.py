"""The ``backend`` settings of ``device=csx`` and the CSX validation rules (no torch, no tracer: importing
this costs nothing). ``num_csx_problem`` is the low-level API's check (``csf.backend``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from ...config.ranges import MAX_PARALLEL, check_range
from ...config.readonly import ReadOnly


@dataclass
class CsxConfig(ReadOnly):
    """``backend.*`` on CSX."""
    type: str = "CSX"
    """The device type this backend runs (``device=csx`` and ``backend=csx`` set it)."""
    retrace_every_iteration: bool = False
    """Trace the step every iteration (side effects every iteration); a changed graph is an error."""
    compile_only: bool = False
    """Trace and compile, write the compile report, train nothing."""
    validate_only: bool = False
    """Trace and check one step, execute nothing."""
    num_csx: int = 1
    """Number of systems (data parallel); global across stages; 1 <= num_csx <= batch size."""
    num_workers_per_csx: int = 0
    """Input workers per system; global across stages (0: the default)."""
    compile_dir: Optional[str] = None
    """Where compiled graphs are cached by fingerprint (``null``: ``~/.cache/csframework/csx``)."""
    threads: Optional[int] = 0
    """torch intra-op threads on the host that emulates the system (the same setting as on CPU/GPU); 0 or
    ``null`` keeps torch's default. Compiled graphs are cached per thread count."""
    graph_compiler: str = "none"
    """How the train step's static graph runs: ``none`` (the default) interprets it (the eager kernels, op by op:
    training starts right after the trace), ``inductor`` compiles it once to host code with TorchInductor (about
    10% faster per step, after a cold compile of about a minute; cached in ``compile_dir``; without a C++
    compiler, or when Inductor fails, the interpreted graph runs, with a one-line warning). The default comes
    from ``$CSF_CSX_GRAPH_COMPILER`` when set."""

    #: Other backends' settings and what does their job here (composition says so when one is given).
    INSTEAD: ClassVar[dict] = dict.fromkeys(
        ("compile", "compile_mode", "compile_fullgraph"),
        "CSX always traces and compiles the whole step; remove it (backend.graph_compiler=inductor compiles the "
        "traced graph to host code, none interprets it)")


def default_compiler() -> str:
    """``backend.graph_compiler``'s default: ``$CSF_CSX_GRAPH_COMPILER`` or ``none`` (the interpreted graph: a
    cold Inductor compile costs more than it saves on a run of minutes, see docs/guides/csx.md)."""
    return os.environ.get(GRAPH_COMPILER_ENV) or "none"


#: ``backend.compile_dir``'s default.
DEFAULT_COMPILE_DIR = "~/.cache/csframework/csx"
#: Values of ``backend.graph_compiler``.
GRAPH_COMPILERS = ("inductor", "none")
#: The environment variable that sets ``backend.graph_compiler``'s default (``conf/backend/csx.yaml`` reads it).
GRAPH_COMPILER_ENV = "CSF_CSX_GRAPH_COMPILER"


def graph_compiler_problem(value: str, key: str) -> str | None:
    """Why ``value`` is not a ``backend.graph_compiler`` (named ``key`` in the message), or ``None``; a value
    that came from ``$CSF_CSX_GRAPH_COMPILER`` is said to, since the command line never showed it."""
    if value in GRAPH_COMPILERS:
        return None
    source = (f" (from the environment variable {GRAPH_COMPILER_ENV}: unset it or set it to inductor or none)"
              if os.environ.get(GRAPH_COMPILER_ENV) == value else "")
    return (f"{key}: {value!r} is not one of {', '.join(GRAPH_COMPILERS)}{source}; "
            f"use {key}=inductor (compile the step) or none (interpret it)")


#: Settings every stage of a run must share.
GLOBAL_SETTINGS = ("num_csx", "num_workers_per_csx")


def num_csx_problem(num_csx: int, batch_size: int | None = None) -> str | None:
    """Why ``num_csx`` cannot work (each system needs at least one sample of a batch), else ``None``; the
    text follows the value (``f"num_csx={n} {problem}"``)."""
    if num_csx < 1:
        return "must be at least 1"
    if batch_size is not None and num_csx > batch_size:
        return (f"is larger than the batch size {batch_size}; each system needs at least one sample: lower "
                "num_csx or raise the batch size")
    return None


def stage_rules(cfg) -> list[str]:
    """The rules of one (stage) config: the CSX settings, and CSX-only precisions elsewhere."""
    problems = []
    if cfg.precision.name == "cbfloat16" and cfg.device.type != "CSX":
        problems.append(f"precision: cbfloat16 needs device=csx (this run's device is {cfg.device.type}); "
                        "use precision=bfloat16 or float16 on CPU/GPU")
    b = cfg.backend
    if not isinstance(b, CsxConfig) or cfg.device.type != "CSX":
        return problems
    problems += check_range("backend.num_csx", b.num_csx, 1, cfg.data.batch_size,
                            hint=" (data.batch_size): each system needs at least one sample")
    problems += check_range("backend.num_workers_per_csx", b.num_workers_per_csx, 0, MAX_PARALLEL,
                            hint=" (0: the default)")
    problems += check_range("backend.threads", b.threads, 0, MAX_PARALLEL, hint=" (0 keeps torch's default)")
    if (problem := graph_compiler_problem(b.graph_compiler, "backend.graph_compiler")) is not None:
        problems.append(problem)
    if b.compile_only and b.validate_only:
        problems.append("backend.compile_only, backend.validate_only: choose one of them")
    return problems + optimizer_rules(cfg)


def optimizer_rules(cfg) -> list[str]:
    """An ``optimizer._target_`` class must have state that can exist before the trace (a CSX graph cannot
    create it): SGD/Adam/AdamW, or a class with ``preinitialize()``. Imports the class (and torch) only when
    one is named; one that does not import is the core validation's to report."""
    target = cfg.optimizer._target_
    if not target:
        return []
    from ...errors import ConfigError
    from ...schedule import locate_class
    from ...graph.optim import preinitialisable

    try:
        cls = locate_class(target, "optimizer._target_")
    except ConfigError:
        return []
    if preinitialisable(cls):
        return []
    return [f"optimizer._target_: {target} cannot run on device=csx: its state is created lazily in step(), "
            "and a CSX graph needs it before the trace; use optimizer=sgd, adam or adamw, or a class with a "
            "preinitialize() method that creates its state"]


def across_stages(config, stages) -> list[str]:
    """CSX global settings are equal in every stage (``stages``: ``(prefix, stage config)`` pairs)."""
    if not isinstance(config.backend, CsxConfig):
        return []
    problems = []
    for prefix, cfg in stages:
        for key in GLOBAL_SETTINGS:
            ours, theirs = getattr(cfg.backend, key, None), getattr(config.backend, key)
            if ours != theirs:
                problems.append(f"{prefix}backend.{key}: {ours} differs from the run's {theirs}; it is global "
                                "across the stages of a run")
    return problems

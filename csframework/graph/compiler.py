"""The emulator's compile step and compile cache, and ``StaticStep``: trace once (or every iteration under
``retrace_every_iteration``), compile, and execute the same graph every iteration.

"Compiling" here is what can be checked and planned without a wafer: clean the graph, fingerprint it, count
its operations, estimate its memory, generate the Python code of the graph, and (``graph_compiler="inductor"``,
the default for the train step) compile that graph to host code with TorchInductor (``inductor.py``), which is
what every execution then runs; without a C++ compiler, or when Inductor fails, the interpreted graph runs
instead and the report says why. The artifact (report, generated code, Inductor artifact) is cached by
fingerprint in ``compile_dir``: an identical graph is a cache hit and skips the compile passes, as an identical
graph skips compilation on a Cerebras cluster.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, TypeAlias

import torch
from torch.utils import _pytree as pytree

from ..errors import CompileError, CsfError
from ..privatedir import PrivateDir
from ..jsonout import dumps
from .cachedir import trusted_root
from . import passes as graphs
from . import flat, inductor
from .replay import Diverged, Recording
from .execution import Execution, deliver
from .tracer import Signature, State, StepTracer, Traced, detailed_difference

REPORT_VERSION = 1


#: The largest compile report read back from a cache entry.
MAX_REPORT_BYTES = 16 << 20


def _well_formed(report, fp: str) -> bool:
    """Whether ``report`` (read back from a cache entry) is what ``compile_traced`` writes for ``fp``, in
    the parts a run reads: this version and graph, an op count, memory figures that are numbers."""
    if not isinstance(report, dict) or report.get("version") != REPORT_VERSION or report.get("fingerprint") != fp:
        return False
    ops, memory = report.get("ops"), report.get("memory", {})
    return (isinstance(ops, dict) and type(ops.get("total")) is int and isinstance(memory, dict)
            and all(type(v) in (int, float) for v in memory.values()))


class CompileCache:
    """``<compile_dir>/<fingerprint>/{report.json, graph.py}``, used only when it is this user's alone
    (``cachedir.trusted_root``: else this process compiles into a private directory of its own, after one
    ``warn``), its entries read and written through the no-follow layer (``privatedir.PrivateDir``)."""

    def __init__(self, directory: str | os.PathLike, warn: Callable[[str], None] | None = None):
        self.directory = trusted_root(directory, warn)

    def entry(self, fp: str) -> Path:
        return self.directory / fp

    def entry_dir(self, fp: str) -> PrivateDir:
        """The entry of fingerprint ``fp``, to read or write files of (``PrivateDir``)."""
        return PrivateDir(self.directory, fp)

    def load(self, fp: str) -> dict | None:
        """The report cached for ``fp``, or None: absent, unreadable, damaged, or not of this version and graph."""
        try:
            report = json.loads(self.entry_dir(fp).read("report.json", MAX_REPORT_BYTES))
        except (OSError, ValueError, CsfError):
            return None
        return report if _well_formed(report, fp) else None

    def store(self, fp: str, report: dict, code: str) -> None:
        try:
            entry = self.entry_dir(fp).sub()
            entry.write("graph.py", code, durable=False)
            entry.write("report.json", dumps(report, indent=2), durable=False)
        except (OSError, CsfError) as e:  # a read-only cache must not stop training
            report.setdefault("warnings", []).append(f"compile cache not written: {e}")


class Compiled:
    """A compiled graph: what every execution runs."""

    def __init__(self, traced: Traced, lines: list[str], fp: str, report: dict, cache_hit: bool,
                 raw_lines: list[str], raw_wheres: list):
        self.traced, self.lines, self.fingerprint = traced, lines, fp
        self.raw_lines = raw_lines  # the canonical form as traced (what retraces are compared with)
        self.raw_wheres = raw_wheres  # the user's line behind each traced node
        self.report, self.cache_hit = report, cache_hit
        self.gm = traced.gm
        self.runner: Callable = traced.gm.forward  # what executes the graph: gm.forward or Inductor's code
        self.execution: Execution | None = None  # the runner on the latest collected state


def _graph_compile(compiled: Compiled, cache: CompileCache | None, graph_compiler: str,
                   config_patches: dict | None = None) -> None:
    """Compile the graph with ``graph_compiler`` (or load it from the cache); on failure keep the
    interpreted graph. ``report["graph_compiler"]`` says which runs, and why."""
    report = compiled.report
    if graph_compiler == "none":
        report["graph_compiler"] = {"name": "none", "status": "interpreted"}
        return
    entry = cache.entry_dir(compiled.fingerprint) if cache is not None else None
    runner, info = inductor.compile_graph(compiled.gm, entry, cache.directory if cache is not None else None,
                                          config_patches)
    if runner is not None:
        compiled.runner = runner
    report["graph_compiler"] = {"name": graph_compiler, **info}


def numerics_key(precision: Any, formats: dict | None = None) -> dict:
    """What decides a compiled graph's numbers besides its operations: the precision policy (format, loss
    scaling: the ``precision`` config), any number ``formats`` the device emulates (CSX's cbfloat16), and
    csframework's and torch's versions. Part of every cache entry's name, so two runs that differ in any of them
    never share an entry."""
    from .. import __version__

    policy = {f.name: getattr(precision, f.name) for f in dataclasses.fields(precision)} \
        if dataclasses.is_dataclass(precision) else dict(precision or {})
    return {"precision": policy, "csframework": __version__, "torch": torch.__version__, **(formats or {})}


def compile_traced(traced: Traced, cache: CompileCache | None, name: str, extra: dict | None = None,
                   graph_compiler: str = "none", config_patches: dict | None = None,
                   key: dict | None = None) -> Compiled:
    """Clean, fingerprint and analyse a traced graph, or take the analysis from the cache; then compile it
    with ``graph_compiler`` (``inductor`` or ``none``: the interpreted graph). The cache entry's name hashes the
    graph, ``key`` (``numerics_key``) and ``config_patches``."""
    raw_lines = graphs.canonical(traced.gm)
    raw_wheres = graphs.wheres(traced.gm)
    graphs.postprocess(traced.gm)
    lines = graphs.canonical(traced.gm)
    context = json.dumps([key, sorted((config_patches or {}).items())], sort_keys=True, default=repr)
    fp = graphs.fingerprint([*lines, f"context {context}"])
    start = time.perf_counter()
    report = cache.load(fp) if cache is not None else None
    hit = report is not None
    if report is None:
        state = traced.state
        kinds = [(kind, kind == "parameter" and t.requires_grad) for kind, t in zip(state.kinds, state.tensors)]
        kinds += [("learning_rate", False)] * len(state.lrs) + [("global_step", False)]
        kinds += [("batch", False)] * len(traced.arg_positions)
        report = {"version": REPORT_VERSION, "fingerprint": fp, "step": name,
                  **graphs.analyse(traced.gm, kinds),
                  "graph_inputs": {"state_tensors": len(traced.state.tensors),
                                   "learning_rates": len(traced.state.lrs), "global_step": 1,
                                   "step_arguments": len(traced.arg_positions)},
                  "graph_outputs": {"step_outputs": len(traced.out_tensor_positions),
                                    "step_closure_values": traced.n_closure_tensors,
                                    "state_write_backs": len(traced.writebacks)},
                  **(extra or {})}
        report["compile_seconds"] = round(time.perf_counter() - start, 6)
        if cache is not None:
            cache.store(fp, report, traced.gm.code)
    # this run's context, also on a cache hit, and its own time analysing the graph or reading the analysis
    report = {**report, **(extra or {}), "analysis_seconds": round(time.perf_counter() - start, 6)}
    report["cache"] = {"status": "hit" if hit else "miss",
                       "entry": str(cache.entry(fp)) if cache is not None else None}
    report["trace_seconds"] = round(traced.seconds, 6)
    compiled = Compiled(traced, lines, fp, report, hit, raw_lines, raw_wheres)
    _graph_compile(compiled, cache, graph_compiler, config_patches)
    return compiled


#: What ``StaticStep.prepare`` hands ``execute``: the graph, the live state and the call's flattened arguments.
Prepared: TypeAlias = "tuple[Compiled, State, list]"


class StaticStep:
    """One step function: traced, compiled, executed (CSX's steps, the CPU's whole step).

    ``keyed=True`` keeps one graph per input signature (evaluation, where the last batch may be short), at
    most ``max_graphs`` of them (then ``prepare`` returns ``None`` for a new signature); otherwise a second signature
    is a ``CompileError`` (a second compile is not allowed). ``graph_compiler`` (``inductor`` or ``none``)
    compiles each new graph, with Inductor's ``config_patches``; a retrace that gives the identical graph runs
    the graph already compiled.
    """

    def __init__(self, fn: Callable, name: str, *, retrace: bool, cache: CompileCache | None,
                 keyed: bool = False, modules=(), optimizers=(), extras=(), compute_context=None,
                 report_extra: Callable[[], dict] | None = None, on_compile: Callable[[Compiled], Any] | None = None,
                 graph_compiler: str = "none", max_graphs: int | None = None, config_patches: dict | None = None,
                 key: dict | None = None):
        self.tracer = StepTracer(fn, name, modules=modules, optimizers=optimizers, extras=extras,
                                 compute_context=compute_context, record=retrace)
        self.name, self.retrace, self.cache, self.keyed = name, retrace, cache, keyed
        self.graph_compiler, self.config_patches, self.max_graphs = graph_compiler, config_patches, max_graphs
        self.key = key  # numerics_key: part of the cache entry's name
        self.report_extra = report_extra or dict
        self.on_compile = on_compile
        self.graphs: dict[Any, tuple[Signature, Compiled]] = {}
        self.first: tuple[Signature, Compiled] | None = None
        self.flatten: flat.Flattener = lambda args, kwargs: None  # flattens the last call's structure
        self.traces = 0
        self.executions = 0
        self.trace_seconds = 0.0
        self.checked_seconds = 0.0  # retraces run as the step itself (``_run_checked``): training time

    @property
    def modules(self):
        return self.tracer.modules

    @property
    def optimizers(self):
        return self.tracer.optimizers

    def _lookup(self, sig: Signature):
        if self.keyed:
            return self.graphs.get(sig.values)
        return self.first

    def prepare(self, args: tuple, kwargs: dict, iteration: int) -> Prepared | None:
        """Trace if needed (always under retrace); returns ``(compiled, state, leaves)`` for ``execute``, or
        ``None`` when ``max_graphs`` graphs are compiled and this call's signature is new to them (the caller
        runs the step without a graph)."""
        leaves = self.flatten(args, kwargs)
        if leaves is None:  # arguments of another structure than the last call's
            self.flatten = flat.flattener(args, kwargs)
            leaves = flat.call_leaves(args, kwargs)
        state, sig = self.tracer.collect(leaves)
        known = self._lookup(sig)
        if known is not None and not self.retrace:
            old_sig, compiled = known
            if old_sig.values != sig.values:
                raise CompileError(
                    f"{self.name}: iteration {iteration} has different inputs than the traced step, so it would "
                    f"need a second compile, which is not allowed: {detailed_difference(old_sig, sig, state)}. "
                    "Keep shapes, dtypes and optimizer settings fixed (e.g. data.drop_last=true).")
            return compiled, state, leaves
        if known is None and self.first is not None and self.max_graphs is not None \
                and len(self.graphs) >= self.max_graphs:
            return None
        if known is not None and known[0].values == sig.values and known[1].traced.recording is not None:
            return self._replayed(known[1], args, kwargs, state, leaves, iteration)
        traced = self.tracer.trace(args, kwargs, state)
        self.traces += 1
        self.trace_seconds += traced.seconds
        if known is None:
            compiled = compile_traced(traced, self.cache, self.name, self.report_extra(), self.graph_compiler,
                                      self.config_patches, self.key)
            self.graphs[sig.values] = (sig, compiled)
            if self.first is None:
                self.first = (sig, compiled)
            if self.on_compile is not None:
                self.on_compile(compiled)
            return compiled, state, leaves
        old_sig, compiled = known
        lines = graphs.canonical(traced.gm)
        if lines != compiled.raw_lines:
            self._differs(iteration, graphs.first_difference(compiled.raw_lines, compiled.raw_wheres, lines,
                                                             graphs.wheres(traced.gm)))
        return self._same_graph(compiled, traced, state, leaves)

    def _replayed(self, compiled: Compiled, args: tuple, kwargs: dict, state: State, leaves: list,
                  iteration: int) -> Prepared:
        """A retrace over the inputs the graph was traced with: the step's Python replayed, its operation
        stream compared with the first trace's (``replay.py``); the same stream is the same graph."""
        recording = self.tracer.replay(args, kwargs, state)
        self.traces += 1
        self.trace_seconds += recording.seconds
        first = compiled.traced.recording
        assert first is not None  # prepare replays only a graph whose first trace was recorded
        difference = recording.first_difference(first)
        if difference is not None:
            self._differs(iteration, difference)
        return self._same_graph(compiled, recording, state, leaves)

    def _differs(self, iteration: int, difference: str) -> NoReturn:
        raise CompileError(
            f"{self.name}: the graph traced at iteration {iteration} differs from the first trace, and a second "
            f"compile is not allowed; {difference}. "
            "Python branches, loops and values in the step must resolve the same way every iteration; "
            "use torch.where for choices that depend on tensor values.")

    @staticmethod
    def _same_graph(compiled: Compiled, retraced: Traced | Recording, state: State, leaves: list) -> Prepared:
        """Run the compiled graph, with this retrace's Python results (step closures to call, non-tensor return
        values); the graph's outputs are the same."""
        for attr in ("closures", "out_spec", "out_leaves", "out_tensor_positions"):
            setattr(compiled.traced, attr, getattr(retraced, attr))
        return compiled, state, leaves

    def execute(self, prepared: Prepared, global_step: int) -> Any:
        """Run a prepared graph on the live state; returns the step's outputs."""
        compiled, state, leaves = prepared
        execution = compiled.execution
        if execution is None or execution.state is not state or execution.run_graph is not compiled.runner:
            execution = compiled.execution = Execution(compiled.traced, state, compiled.runner)
        out = execution(leaves, global_step)
        self.executions += 1
        return out

    def __call__(self, args: tuple, kwargs: dict, *, iteration: int, global_step: int) -> Any:
        """Prepare and execute (a step without ``max_graphs``: every call has its graph)."""
        if self.retrace:
            done = self._run_checked(args, kwargs, iteration, global_step)
            if done is not None:
                return done[0]
        return self.execute(self._prepared(args, kwargs, iteration), global_step)

    def _run_checked(self, args: tuple, kwargs: dict, iteration: int, global_step: int) -> tuple[Any] | None:
        """A retrace of an interpreted graph over the inputs it was traced with: the step's Python runs on the
        live tensors, each operation checked against the first trace's before it runs, which executes the
        graph's operations in its order with its kernels (``StepTracer.run_checked``); returns ``(outputs,)``,
        or ``None`` where this does not apply (a compiled graph, new inputs, a stream not recorded)."""
        leaves = flat.call_leaves(args, kwargs)
        state, sig = self.tracer.collect(leaves)
        known = self._lookup(sig)
        if known is None or known[0].values != sig.values:
            return None
        compiled = known[1]
        recording = compiled.traced.recording
        if recording is None or compiled.runner != compiled.gm.forward:
            return None
        start = time.perf_counter()
        try:
            checked, results = self.tracer.run_checked(args, kwargs, state, recording, global_step)
        except Diverged as e:
            self._differs(iteration, e.difference)
        out = deliver(checked, state.optimizers, results)
        self.traces += 1
        self.executions += 1
        self.checked_seconds += time.perf_counter() - start
        return (out,)

    def compile_only(self, args: tuple, kwargs: dict, iteration: int = 1) -> Compiled:
        return self._prepared(args, kwargs, iteration)[0]

    def _prepared(self, args: tuple, kwargs: dict, iteration: int) -> Prepared:
        prepared = self.prepare(args, kwargs, iteration)
        if prepared is None:
            raise CompileError(f"{self.name}: {self.max_graphs} graphs compiled already and iteration {iteration} "
                               "would need another; keep the input shapes fixed (e.g. data.drop_last=true)")
        return prepared

    def validate_only(self, args: tuple, kwargs: dict) -> Traced:
        """Trace and check one step; nothing is compiled or executed."""
        leaves, _ = pytree.tree_flatten((args, kwargs))
        state, _ = self.tracer.collect(leaves)
        traced = self.tracer.trace(args, kwargs, state)
        self.traces += 1
        self.trace_seconds += traced.seconds
        graphs.postprocess(traced.gm)
        return traced

    def stats(self) -> dict:
        return {"traces": self.traces, "executions": self.executions,
                "trace_seconds": round(self.trace_seconds, 4), "graphs": len(self.graphs),
                "checked_seconds": round(self.checked_seconds, 4)}


def device_for_host() -> torch.device:
    """Where the emulator executes graphs: CUDA when present, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

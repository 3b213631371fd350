"""CSX emulator figures: the steady-state step of ``device=csx`` against eager CPU on the embedded default
model (tiny transformer, AdamW, clipping), and the time to trace and compile the step, cold and cached.

    python -m benchmarks.csx_emulator [--rounds N]       # the figures (fresh processes, interleaved)
    python -m benchmarks.csx_emulator --detail           # one process: trace, steps, retrace cost
    python -m benchmarks.csx_emulator --contestant csx   # one measurement (a JSON line)
    python -m benchmarks.csx_emulator --own-time         # the emulator's own work per step (issue 52)
    python -m benchmarks.csx_emulator --opcodes [N]      # the same counted: bytecodes and C calls (N functions)

Each contestant process builds the run, times ``backend.train_batch`` (the whole optimizer step: forward,
backward, clipping, update, schedule) on one fixed batch for ``--steps`` steps after warm-up, and reports the
median ms/step (wall time, and the process's CPU time, which a busy shared machine inflates less); data
loading and logging are not part of it. The csx contestant also reports its first
step's trace + graph compile seconds. The figures' csx contestants share one compile directory: the first
csx process (run once, before the rounds) finds it empty (the cold figure), the rounds find it filled (the
cached figure).

The emulator's own work per step (``--own-time``, issue 52's CSX target: at most 50 us) is a step's CPU time
less the CPU time of the graph's operations alone: in one process, on the blobs MLP with
``backend.graph_compiler=none`` (the interpreted graph, the default), steps of ``backend.train_batch``
alternate with calls of the same graph's generated code (``GraphModule.forward``, every node's ATen
operation and nothing else) on the same live tensors; the difference of their medians (and of their 10th
percentiles, nearer a quiet machine's figure on a shared one) is what the emulator adds around the operations (state check, graph inputs, outputs and step closures), and with
``backend.retrace_every_iteration=true`` also what checking each operation against the first trace costs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

QUIET = ["plugins.disable=[progress,logging,checkpoint,metrics]", "data.val=null", "loop.eval_every=null"]
MODULE = "benchmarks.csx_emulator"


def make_run(device: str, model: str, extra: list[str], workdir: str, compile_dir: str | None = None):
    import csframework as csf

    compiled = device == "compiled"  # device=cpu with backend.compile=true
    device = "cpu" if compiled else device
    overrides = [f"device={device}", "loop.max_steps=100000", *QUIET, *extra,
                 *(["backend.compile=true"] if compiled else [])]
    if device == "csx":
        overrides.append(f"backend.compile_dir={compile_dir or workdir + '/compile'}")
    if model == "mlp":
        from fixtures import CONF
        cfg = csf.compose(["model=blobs_mlp", "data=blobs", "optimizer=adamw", *overrides], config_dir=CONF)
    else:
        cfg = csf.compose(overrides)
    run = csf.Run(cfg, output_dir=f"{workdir}/{device}-{len(extra)}-{int(compiled)}")
    run.module.train()
    batch = run.backend.to_device(next(iter(run.train_loader)))
    return run, batch


def step_times(run, batch, steps: int, clock=time.perf_counter) -> list[float]:
    times = []
    for _ in range(steps):
        start = clock()
        out = run.backend.train_batch(run, batch, True)
        out["loss"].item()  # the step's value is available (no-op sync on CPU)
        times.append(clock() - start)
        run.state.global_step += 1  # what the loop does after a step
    return times


def contestant(name: str, steps: int, compile_dir: str | None, graph_compiler: str | None) -> dict:
    """One fresh-process measurement: median ms/step over ``steps`` steady-state steps (and, on csx, the
    first step's trace + compile seconds)."""
    import torch

    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    extra = [f"backend.graph_compiler={graph_compiler}"] if graph_compiler and name == "csx" else []
    with tempfile.TemporaryDirectory() as workdir:
        run, batch = make_run(name, "default", extra, workdir, compile_dir)
        result = {"contestant": name, "threads": torch.get_num_threads()}
        step_times(run, batch, 1)
        if name == "compiled":
            result.update(compile_s=run.backend.compiled.seconds, cache=run.backend.compiled.cache_status())
        if name == "csx":
            report = run.backend.compiled.report
            info = report.get("graph_compiler", {})
            result.update(trace_s=report["trace_seconds"], graph_compile_s=info.get("seconds", 0.0),
                          trace_compile_s=report["trace_seconds"] + info.get("seconds", 0.0),
                          graph_compiler=info.get("status"))
        step_times(run, batch, 3)
        result["ms_per_step"] = 1e3 * statistics.median(step_times(run, batch, steps))
        # CPU time of the process: what a step costs without the waits for a core that other processes on a
        # shared machine add to the wall time
        result["cpu_ms_per_step"] = 1e3 * statistics.median(step_times(run, batch, steps, time.process_time))
    return result


@contextlib.contextmanager
def own_setup(retrace: bool):
    """The blobs MLP's CSX run after 20 steps, one batch, and a call of its graph's generated code alone on
    the same live tensors: ``(run, batch, graph_once, graph_nodes)``."""
    import torch

    from csframework.graph.tracer import _inputs
    from torch.utils import _pytree as pytree

    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    extra = ["backend.graph_compiler=none", *(["backend.retrace_every_iteration=true"] if retrace else [])]
    with tempfile.TemporaryDirectory() as workdir:
        run, batch = make_run("csx", "mlp", extra, workdir)
        step_times(run, batch, 20)
        train_step = run.backend.train_step
        compiled = train_step.first[1]
        leaves, _ = pytree.tree_flatten((([batch],), {}))
        state, _ = train_step.tracer.collect(leaves)
        inputs = _inputs(state, leaves, compiled.traced.arg_positions, run.global_step)
        graph = compiled.gm.forward

        def graph_once():
            with torch.no_grad():
                graph(*inputs)

        yield run, batch, graph_once, len(compiled.gm.graph.nodes)


def own_time(retrace: bool, steps: int = 400) -> dict:
    """The emulator's own CPU time per step (see the module's docstring): median step less median graph."""
    with own_setup(retrace) as (run, batch, graph_once, nodes):
        step, ops = [], []
        for _ in range(steps):  # alternated, so that both see the same machine
            step += step_times(run, batch, 1, time.process_time)
            start = time.process_time()
            graph_once()
            ops.append(time.process_time() - start)
    step_us, ops_us = 1e6 * statistics.median(step), 1e6 * statistics.median(ops)
    # the quietest tenth of each: on a shared machine the other processes' caches and interruptions inflate
    # some iterations, and the least disturbed ones are nearest to a quiet machine's figure
    quiet_step, quiet_ops = (1e6 * statistics.quantiles(times, n=10)[0] for times in (step, ops))
    return {"contestant": "own-retrace" if retrace else "own", "step_us": step_us, "graph_ops_us": ops_us,
            "own_us_per_step": step_us - ops_us, "own_us_quietest": quiet_step - quiet_ops, "graph_ops": nodes}


def own_opcodes(functions: int, steps: int = 200) -> dict[str, dict[str, float]]:
    """The emulator's own work per step counted, a figure the load does not move: Python bytecode instructions
    and C calls from Python (``benchmarks.opcodes``' counter) of ``steps`` steps less those of as many runs of
    the graph alone, and the ``functions`` that make the most of the difference; returns the counts a step by
    function (``file:line:name``) or C function."""
    from .opcodes import Counter, _by_name

    with own_setup(False) as (run, batch, graph_once, _):
        counters = {"step": Counter(), "graph": Counter()}
        for name, one in (("step", lambda: step_times(run, batch, 1)), ("graph", graph_once)):
            counters[name].on()
            try:
                for _ in range(steps):
                    one()
            finally:
                counters[name].off()
    counts = {}
    for what in ("opcodes", "c_calls"):
        step, graph = (_by_name(getattr(counters[name], what)) for name in ("step", "graph"))
        own = counts[what] = {key: (step.get(key, 0) - graph.get(key, 0)) / steps for key in set(step) | set(graph)}
        print(f"{what} per step, the emulator's own (step less graph): {sum(own.values()):,.1f}")
        for key in sorted(own, key=lambda k: -abs(own[k]))[:functions]:
            print(f"{own[key]:+10.1f}  {key}")
    return counts


def own_figures(rounds: int) -> list:
    """Issue 52's CSX figure: the emulator's own CPU time per step, without and with retracing."""
    from . import harness

    base = harness.python(MODULE)
    results = harness.interleaved({"own": [*base, "--contestant", "own"],
                                   "own-retrace": [*base, "--contestant", "own-retrace"]}, rounds)
    command = f"python -m {MODULE} --own-time --rounds {rounds}"
    return [
        harness.Figure("CSX emulator's own CPU time per step (blobs MLP, graph_compiler=none): step less the "
                       "graph's operations", "us", [r["own_us_per_step"] for r in results["own"]],
                       target="<= 50 us", limit=50.0, command=command, kind="value"),
        harness.Figure("the same, the quietest tenth of the steps and of the graph's runs (10th percentiles)", "us",
                       [r["own_us_quietest"] for r in results["own"]], target="<= 50 us", limit=50.0,
                       command=command, kind="value"),
        harness.Figure("the same with retrace_every_iteration=true (each operation checked)", "us",
                       [r["own_us_per_step"] for r in results["own-retrace"]], command=command, kind="value"),
        harness.Figure("the graph's operations alone (what the figures above leave out)", "us",
                       [r["graph_ops_us"] for r in results["own"]], command=command, kind="value"),
    ]


def figures(rounds: int, steps: int = 20) -> list:
    from . import harness

    base = harness.python(MODULE, "--steps", str(steps))
    compile_dir = tempfile.mkdtemp(prefix="csf-csx-bench-")
    try:
        csx = [*base, "--contestant", "csx", "--compile-dir", compile_dir]
        cold = harness.run_once(csx)  # the empty compile directory: a cold trace + compile, and the cache filled
        results = harness.interleaved({"csx": csx, "cpu": [*base, "--contestant", "cpu"],
                                       "compiled": [*base, "--contestant", "compiled"]}, rounds)
    finally:
        shutil.rmtree(compile_dir, ignore_errors=True)
    command = f"python -m {MODULE} --rounds {rounds}"
    return [
        harness.Figure("CSX steady-state step vs eager (embedded default)", "ms/step",
                       [r["ms_per_step"] for r in results["csx"]], baseline="eager cpu",
                       baseline_samples=[r["ms_per_step"] for r in results["cpu"]], target="<= 0.8x", limit=0.8,
                       command=command),
        harness.Figure("CSX steady-state step vs eager, CPU time", "ms/step",
                       [r["cpu_ms_per_step"] for r in results["csx"]], baseline="eager cpu",
                       baseline_samples=[r["cpu_ms_per_step"] for r in results["cpu"]], target="<= 0.8x",
                       limit=0.8, command=command),
        harness.Figure("backend.compile=true steady-state step vs eager (embedded default, cpu)", "ms/step",
                       [r["ms_per_step"] for r in results["compiled"]], baseline="eager cpu",
                       baseline_samples=[r["ms_per_step"] for r in results["cpu"]], target="<= 0.9x", limit=0.9,
                       command=command),
        harness.Figure("backend.compile=true steady-state step vs eager, CPU time", "ms/step",
                       [r["cpu_ms_per_step"] for r in results["compiled"]], baseline="eager cpu",
                       baseline_samples=[r["cpu_ms_per_step"] for r in results["cpu"]], target="<= 0.9x",
                       limit=0.9, command=command),
        harness.Figure("backend.compile=true compile time (embedded default; Inductor's cache filled by the first "
                       "round)", "s", [r["compile_s"] for r in results["compiled"]], command=command, kind="value"),
        harness.Figure("CSX trace+compile, cached", "s", [r["trace_compile_s"] for r in results["csx"]],
                       target="<= 2 s", limit=2.0, command=command, kind="value"),
        harness.Figure("CSX trace+compile, cold (empty cache)", "s", [cold["trace_compile_s"]], command=command,
                       kind="value"),
        *own_figures(rounds),
    ]


def detail(model: str, steps: int, repeats: int, threads: int, compile_dir: str | None = None) -> dict:
    """One process: trace time, first step, csx and eager steps alternating, the retrace cost."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as workdir:
        csx, batch = make_run("csx", model, [], workdir, compile_dir)
        start = time.perf_counter()
        step_times(csx, batch, 1)
        first_step = time.perf_counter() - start
        compiled = csx.backend.compiled
        trace_s = compiled.report["trace_seconds"]
        compiler = compiled.report.get("graph_compiler", {})
        cpu, cpu_batch = make_run("cpu", model, [], workdir)
        step_times(cpu, cpu_batch, 3)
        step_times(csx, batch, 3)
        csx_runs, cpu_runs = [], []
        for _ in range(repeats):  # alternate csx and cpu step by step, so both see the same machine load
            pairs = [(step_times(csx, batch, 1)[0], step_times(cpu, cpu_batch, 1)[0]) for _ in range(steps)]
            csx_runs.append(statistics.median(p[0] for p in pairs))
            cpu_runs.append(statistics.median(p[1] for p in pairs))
        retrace, retrace_batch = make_run("csx", model, ["backend.retrace_every_iteration=true"], workdir,
                                          compile_dir)
        step_times(retrace, retrace_batch, 2)
        retrace_step = statistics.median(step_times(retrace, retrace_batch, max(5, steps // 3)))
    figures = {
        "model": model, "torch_threads": torch.get_num_threads(), "graph_ops": compiled.report["ops"]["total"],
        "graph_compiler": compiler.get("status"), "graph_compile_s": compiler.get("seconds", 0.0),
        "trace_s": trace_s, "first_step_s (trace+compile+run)": first_step,
        "csx_step_ms": 1e3 * min(csx_runs), "cpu_eager_step_ms": 1e3 * min(cpu_runs),
        "csx_vs_eager": min(csx_runs) / min(cpu_runs),
        "retrace_step_ms": 1e3 * retrace_step, "retrace_cost_per_step_ms": 1e3 * (retrace_step - min(csx_runs)),
    }
    print(f"CSX emulator benchmark ({model} model, {figures['graph_ops']} graph ops, "
          f"{figures['torch_threads']} torch threads, graph compiler: {figures['graph_compiler']})")
    print(f"  trace time (first step's trace)          {trace_s * 1e3:9.1f} ms")
    print(f"  graph compile (or cache load)            {figures['graph_compile_s'] * 1e3:9.1f} ms")
    print(f"  first step (trace + compile + execute)   {first_step * 1e3:9.1f} ms")
    print(f"  steady-state step, csx graph             {figures['csx_step_ms']:9.2f} ms")
    print(f"  steady-state step, eager cpu             {figures['cpu_eager_step_ms']:9.2f} ms")
    print(f"  csx / eager                              {figures['csx_vs_eager']:9.2f}x")
    print(f"  step with retrace_every_iteration        {figures['retrace_step_ms']:9.1f} ms")
    print(f"  retrace cost per step                    {figures['retrace_cost_per_step_ms']:9.1f} ms")
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of fresh processes")
    parser.add_argument("--steps", type=int, default=20, help="steady-state steps timed per process")
    parser.add_argument("--contestant", choices=["csx", "cpu", "compiled", "own", "own-retrace"],
                        help="one measurement, printed as JSON (compiled: cpu with backend.compile=true; own: the "
                             "emulator's own time per step, own-retrace: with retracing)")
    parser.add_argument("--own-time", action="store_true", help="only the emulator's own time per step")
    parser.add_argument("--opcodes", type=int, nargs="?", const=0, default=None, metavar="N",
                        help="the emulator's own bytecode instructions and C calls per step, counted (and the N "
                             "functions that count most)")
    parser.add_argument("--compile-dir", default=None, help="the csx contestant's compile directory")
    parser.add_argument("--graph-compiler", choices=["inductor", "none"], default=None,
                        help="the csx contestant's backend.graph_compiler (default: the config's)")
    parser.add_argument("--detail", action="store_true", help="the one-process detail printout")
    parser.add_argument("--model", choices=["default", "mlp"], default="default", help="--detail's model")
    parser.add_argument("--repeats", type=int, default=3, help="--detail's repeats")
    parser.add_argument("--threads", type=int, default=0, help="--detail's torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.opcodes is not None:
        own_opcodes(args.opcodes)
    elif args.contestant in ("own", "own-retrace"):
        print(json.dumps(own_time(args.contestant == "own-retrace")))
    elif args.contestant:
        print(json.dumps(contestant(args.contestant, args.steps, args.compile_dir, args.graph_compiler)))
    elif args.own_time:
        from . import harness
        print(harness.table(own_figures(args.rounds)))
    elif args.detail:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                                        "support"))  # the test fixtures (mlp model)
        detail(args.model, args.steps, args.repeats, args.threads, args.compile_dir)
    else:
        from . import harness
        print(harness.table(figures(args.rounds, args.steps)))


if __name__ == "__main__":
    main()

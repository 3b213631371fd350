"""CSX emulator figures: trace time, steady-state step time on csx vs eager cpu on the same model, and the
per-step cost of ``retrace_every_iteration``.

    python benchmarks/csx_emulator.py                    # the embedded default (tiny transformer, AdamW)
    python benchmarks/csx_emulator.py --steps 50 --model mlp

Each figure times ``backend.train_batch`` (the whole optimizer step: forward, backward, clipping, update,
schedule) on one fixed batch, after warm-up, so data loading and logging are not part of it. Steady-state
times are medians over ``--steps`` steps, csx and cpu steps alternating, repeated ``--repeats`` times and the
best repeat reported: the usual way to take timings on a shared machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures (mlp model)

import csframework as csf  # noqa: E402

QUIET = ["plugins.disable=[progress,logging,checkpoint,metrics]", "data.val=null", "loop.eval_every=null"]


def make_run(device: str, model: str, extra: list[str], workdir: str):
    overrides = [f"device={device}", "loop.max_steps=1000", *QUIET, *extra]
    if device == "csx":
        overrides.append(f"backend.compile_dir={workdir}/compile")
    if model == "mlp":
        from fixtures import CONF
        cfg = csf.compose(["model=blobs_mlp", "data=blobs", "optimizer=adamw", *overrides], config_dir=CONF)
    else:
        cfg = csf.compose(overrides)
    run = csf.Run(cfg, output_dir=f"{workdir}/{device}-{len(extra)}")
    run.module.train()
    batch = run.backend.to_device(next(iter(run.train_loader)))
    return run, batch


def step_times(run, batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = run.backend.train_batch(run, batch, True)
        out["loss"].item()  # the step's value is available (no-op sync on CPU)
        times.append(time.perf_counter() - start)
        run.state.global_step += 1  # what the loop does after a step
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["default", "mlp"], default="default")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        csx, batch = make_run("csx", args.model, [], workdir)
        start = time.perf_counter()
        step_times(csx, batch, 1)
        first_step = time.perf_counter() - start
        compiled = csx.backend.compiled
        trace_s = compiled.report["trace_seconds"]
        cpu, cpu_batch = make_run("cpu", args.model, [], workdir)
        step_times(cpu, cpu_batch, 3)
        step_times(csx, batch, 3)
        csx_runs, cpu_runs = [], []
        for _ in range(args.repeats):  # alternate csx and cpu step by step, so both see the same machine load
            pairs = [(step_times(csx, batch, 1)[0], step_times(cpu, cpu_batch, 1)[0]) for _ in range(args.steps)]
            csx_runs.append(statistics.median(p[0] for p in pairs))
            cpu_runs.append(statistics.median(p[1] for p in pairs))
        retrace, retrace_batch = make_run("csx", args.model, ["backend.retrace_every_iteration=true"], workdir)
        step_times(retrace, retrace_batch, 2)
        retrace_step = statistics.median(step_times(retrace, retrace_batch, max(5, args.steps // 3)))
    figures = {
        "model": args.model, "torch_threads": torch.get_num_threads(), "graph_ops": compiled.report["ops"]["total"],
        "trace_s": trace_s, "first_step_s (trace+compile+run)": first_step,
        "csx_step_ms": 1e3 * min(csx_runs), "cpu_eager_step_ms": 1e3 * min(cpu_runs),
        "csx_vs_eager": min(csx_runs) / min(cpu_runs),
        "retrace_step_ms": 1e3 * retrace_step, "retrace_cost_per_step_ms": 1e3 * (retrace_step - min(csx_runs)),
    }
    print(f"CSX emulator benchmark ({args.model} model, {figures['graph_ops']} graph ops, "
          f"{figures['torch_threads']} torch threads)")
    print(f"  trace time (first step's trace)          {trace_s * 1e3:9.1f} ms")
    print(f"  first step (trace + compile + execute)   {first_step * 1e3:9.1f} ms")
    print(f"  steady-state step, csx graph             {figures['csx_step_ms']:9.2f} ms")
    print(f"  steady-state step, eager cpu             {figures['cpu_eager_step_ms']:9.2f} ms")
    print(f"  csx / eager                              {figures['csx_vs_eager']:9.2f}x")
    print(f"  step with retrace_every_iteration        {figures['retrace_step_ms']:9.1f} ms")
    print(f"  retrace cost per step                    {figures['retrace_cost_per_step_ms']:9.1f} ms")
    return figures


if __name__ == "__main__":
    main()

"""``backend.compile=true``'s compile time, cold and cached, and what the compiled step saves (issue 38).

For the embedded default transformer (``python -m csframework backend.compile=true``'s model) and the
nanoGPT-shaped model of ``examples/char_gpt/gpt.py`` (128 wide, 4 heads, 64 characters of context, batch 12)
with 1, 4 and 12 layers, each in fresh processes on one thread:

* cold: a run compiling into an empty Inductor cache of its own (a new ``$TORCHINDUCTOR_CACHE_DIR``, which also
  holds csframework's compile cache): ``summary.json``'s ``compile.seconds``, training and evaluation;
* cached: a second identical run with the same cache;
* the step: the cached run's seconds per step (compiling left out) over an eager run's.

    python -m benchmarks.compile_time                   # every model, as backend.compile=true chooses: a model
                                                        # of repeated blocks per function, each block once
    python -m benchmarks.compile_time --only gpt-1 gpt-12
    python -m benchmarks.compile_time --whole-step      # backend.compile_whole_step=true: the whole step traced
    python -m benchmarks.compile_time --per-function    # backend.compile_whole_step=false
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import harness

#: The models measured: the default transformer, and the nanoGPT-shaped one with this many layers.
MODELS = {"default": 0, "gpt-1": 1, "gpt-4": 4, "gpt-12": 12}
#: Training steps of each run (the first compiles), then one evaluation of ``EVAL_STEPS`` batches.
STEPS, EVAL_STEPS = 30, 2
#: The issue's targets: 12 layers' cold compile over 1 layer's, the default transformer's cold and cached seconds.
DEPTH_LIMIT, DEFAULT_COLD_S, CACHED_S = 1.5, 30.0, 3.0


def overrides(model: str, compiled: bool, how: str = "") -> list[str]:
    """The run's settings: ``model`` (a ``MODELS`` key), ``STEPS`` steps, one evaluation, one thread; ``how``:
    ``whole-step`` or ``per-function`` (``backend.compile_whole_step`` true or false), else the default."""
    common = [f"loop.max_steps={STEPS}", f"loop.eval_every={STEPS}", f"loop.eval_steps={EVAL_STEPS}",
              f"loop.log_every={STEPS // 3}", "backend.threads=1", "checkpoint.every_steps=null",
              f"backend.compile={str(compiled).lower()}"]
    if compiled and how:
        common.append(f"backend.compile_whole_step={str(how == 'whole-step').lower()}")
    layers = MODELS[model]
    if not layers:
        return common
    return [*common, "data.batch_size=12", "~model", "+model._target_=gpt.CharGPT", "+model.vocab_size=256",
            "+model.block_size=64", f"+model.layers={layers}", "+model.heads=4", "+model.width=128"]


def contestant(model: str, compiled: bool, how: str = "") -> dict:
    """One run in this process: its compile seconds and seconds per step (compiling left out)."""
    import csframework as csf

    with tempfile.TemporaryDirectory(prefix="csf-bench-compile-") as out:
        summary = csf.Run(csf.compose(overrides(model, compiled, how)), output_dir=out).fit()
    assert summary["status"] == "completed", summary
    block = summary.get("compile") or {}
    return {"compile_s": block.get("seconds", 0.0), "s_per_step": 1.0 / summary["metrics"]["steps_per_sec"],
            "graph": block.get("graph", ""), "regions": block.get("regions", ""), "cache": block.get("cache", "")}


def measure(model: str, how: str = "") -> dict:
    """Cold, cached and eager runs of ``model``, each a fresh process; the cold one with an empty private cache."""
    cache = tempfile.mkdtemp(prefix="csf-bench-inductor-")
    env = harness.contestant_env(threads=1)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    env["PYTHONPATH"] = os.pathsep.join([str(harness.ROOT / "examples" / "char_gpt"), env["PYTHONPATH"]])
    command = harness.python("benchmarks.compile_time", "--contestant", model,
                             *([f"--{how}"] if how else []))
    try:
        cold = harness.run_once(command + ["--compile"], env=env, timeout=1800)
        cached = harness.run_once(command + ["--compile"], env=env)
        eager = harness.run_once(command, env=env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"model": model, "cold_s": cold["compile_s"], "cached_s": cached["compile_s"],
            "step_ratio": cached["s_per_step"] / eager["s_per_step"], "graph": cold["graph"],
            "regions": cold["regions"], "cached_hit": cached["cache"]}


def report(rows: list[dict]) -> str:
    """The figures as a markdown table, with the issue's targets checked where both figures were measured."""
    lines = ["| model | how it compiles | cold compile (s) | cached compile (s) | compiled / eager step |",
             "|---|---|---|---|---|"]
    for r in rows:
        how = r["graph"] + (f" ({r['regions']} compiled once)" if r["regions"] else "")
        lines.append(f"| {r['model']} | {how} | {r['cold_s']:.1f} | {r['cached_s']:.1f} | {r['step_ratio']:.2f}x |")
    by = {r["model"]: r for r in rows}
    if "gpt-1" in by and "gpt-12" in by:
        ratio = by["gpt-12"]["cold_s"] / by["gpt-1"]["cold_s"]
        lines.append(f"\n12 layers' cold compile / 1 layer's: {ratio:.2f}x (target <= {DEPTH_LIMIT}x)")
    if "default" in by:
        d = by["default"]
        lines.append(f"default transformer: cold {d['cold_s']:.1f} s (target <= {DEFAULT_COLD_S:.0f} s), cached "
                     f"{d['cached_s']:.1f} s (target <= {CACHED_S:.0f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(MODELS), help="these models only")
    parser.add_argument("--json", help="save the rows to this file")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--whole-step", action="store_true",
                     help="trace the whole step into one graph (backend.compile_whole_step=true)")
    how.add_argument("--per-function", action="store_true",
                     help="compile per function (backend.compile_whole_step=false): repeated blocks once each")
    parser.add_argument("--contestant", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = "whole-step" if args.whole_step else "per-function" if args.per_function else ""
    if args.contestant:
        print(json.dumps(contestant(args.contestant, args.compile, chosen)))
        return 0
    harness.cache_bytecode()
    rows = []
    for model in args.only or list(MODELS):
        print(f"measuring {model} ...", file=sys.stderr, flush=True)
        rows.append(measure(model, chosen))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(report(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

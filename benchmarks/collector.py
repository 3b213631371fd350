"""The output collector's cost, and fsdp vs ddp step time on CPU.

1. Collector: a model whose evaluation outputs a wide row per sample (``--width`` float32 values, 4 KiB at
   1024) over ``--samples`` validation samples, evaluated ``--rounds`` times in one process three ways: no
   ``loop.collect``; collected in memory; collected with ``loop.collect_max_memory_mb=--spill-mb`` (spilled
   to memory-mapped files). Each way runs in a fresh process; it reports the seconds per evaluation (the
   overhead over no collection) and the peak RSS growth of the process during the evaluations (``ru_maxrss``
   minus the RSS before the first one). The hook reads only the last row, so the pages of a memory-mapped
   result that a user's hook would read do not count.
2. fsdp vs ddp: ``torchrun --nproc_per_node=2`` on CPU (gloo), the same MLP (``--hidden`` wide, 4 layers),
   ``--steps`` AdamW steps; seconds per step from the runs' own ``steps_per_sec`` (the last log), no
   checkpoints.

    python benchmarks/collector.py                    # about two minutes on 2 CPU cores
    python benchmarks/collector.py --samples 2000 --steps 20 --rounds 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

MB = 1024 * 1024


class Points(Dataset):
    def __init__(self, n: int = 1024, dim: int = 32, classes: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = torch.randn(n, dim, generator=g) + self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Wide(nn.Module):
    """A classifier whose outputs also hold a ``width``-wide feature row per sample."""

    def __init__(self, width: int = 1024, hidden: int = 64, dim: int = 32, classes: int = 8, layers: int = 2):
        super().__init__()
        blocks = [nn.Linear(dim, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, classes)
        self.width = width

    def forward(self, batch):
        x, y = batch
        h = self.body(x)
        logits = self.head(h)
        features = h.detach().repeat(1, max(1, self.width // h.shape[1]))
        return {"loss": nn.functional.cross_entropy(logits, y), "features": features, "labels": y}


def write_configs(conf: Path, samples: int, width: int, hidden: int, layers: int) -> None:
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir()
    (conf / "model" / "bench.yaml").write_text(
        f"_target_: collector.Wide\nwidth: {width}\nhidden: {hidden}\nlayers: {layers}\n")
    (conf / "data" / "bench.yaml").write_text(
        "train:\n  _target_: collector.Points\n  n: 4096\n"
        f"val:\n  _target_: collector.Points\n  n: {samples}\n  seed: 1\nbatch_size: 64\n")


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def collector_child(conf: str, mode: str, rounds: int, spill_mb: float) -> None:
    """One way of evaluating, in this (fresh) process; prints a JSON line."""
    import csframework as csf
    from csframework import evaluation

    overrides = ["model=bench", "data=bench", "loop.max_steps=1", "data.eval_batch_size=256"]
    if mode != "none":
        overrides.append("loop.collect=[features,labels]")
    if mode == "spilled":
        overrides.append(f"loop.collect_max_memory_mb={spill_mb}")
    torch.set_num_threads(1)
    seen = []

    class Touch:  # reads the last row of each output: the collected tensors exist, their pages stay unread
        @csf.hookimpl
        def on_eval_end(self, run):
            seen.append({k: (len(v), float(v[-1:].float().sum())) for k, v in run.eval_outputs.items()})

    with tempfile.TemporaryDirectory() as out, open(os.devnull, "w") as devnull, \
            contextlib.redirect_stderr(devnull):
        run = csf.Run(csf.compose(overrides, config_dir=conf), plugins=[Touch()], output_dir=out)
        run.hooks.on_fit_start(run=run)
        before = current_rss()
        start = time.perf_counter()
        for _ in range(rounds):
            evaluation.evaluate(run)
        seconds = (time.perf_counter() - start) / rounds
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": mode, "seconds": seconds, "peak_growth": max(0, peak - before)}))


def run_collector(args, conf: Path, env: dict) -> dict:
    results = {}
    for mode in ("none", "memory", "spilled"):
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--conf", str(conf),
                               "--rounds", str(args.rounds), "--spill-mb", str(args.spill_mb)],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def step_time(strategy: str, args, conf: Path, env: dict) -> float:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", "--config-dir", str(conf),
                               "model=bench", "data=bench", "data.val=null", f"loop.max_steps={args.steps}",
                               f"loop.log_every={args.steps}", "optimizer=adamw", "checkpoint.save_at_end=false",
                               f"backend.strategy={strategy}", f"hydra.run.dir={out}"],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        summary = json.loads((Path(out) / "summary.json").read_text())
    return 1.0 / summary["metrics"]["steps_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spill-mb", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--child", choices=["none", "memory", "spilled"])
    parser.add_argument("--conf")
    args = parser.parse_args()
    if args.child:
        collector_child(args.conf, args.child, args.rounds, args.spill_mb)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "conf"
        write_configs(conf, args.samples, args.width, args.hidden, layers=4)
        collected = run_collector(args, conf, env)
        ddp, fsdp = (step_time(s, args, conf, env) for s in ("ddp", "fsdp"))
    size = args.samples * (args.width * 4 + 8) / MB
    print(f"collector: {args.samples} samples x {args.width} float32 features + labels ({size:.1f} MB per "
          f"evaluation), {args.rounds} evaluations; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"  {'mode':<28} {'s / evaluation':>15} {'overhead':>9} {'peak RSS growth MB':>19}")
    base = collected["none"]["seconds"]
    for mode, label in (("none", "no loop.collect"), ("memory", "collected in memory"),
                        ("spilled", f"spilled (max {args.spill_mb:g} MB)")):
        r = collected[mode]
        print(f"  {label:<28} {r['seconds']:>15.3f} {r['seconds'] / base - 1:>+9.1%} "
              f"{r['peak_growth'] / MB:>19.1f}")
    print(f"fsdp vs ddp: 2 ranks on CPU (gloo), MLP 32-{args.hidden}x4-8, batch 64 per rank, AdamW, "
          f"{args.steps} steps")
    print(f"  ddp  {ddp * 1000:8.2f} ms/step")
    print(f"  fsdp {fsdp * 1000:8.2f} ms/step  ({fsdp / ddp:.2f}x ddp)")


if __name__ == "__main__":
    main()

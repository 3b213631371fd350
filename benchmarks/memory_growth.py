"""Memory growth: does a long run hold more memory the more steps it takes?

Trains a tiny model (an 8-16-4 MLP on an in-memory blob dataset, batch 16, AdamW, dropout) for
``--steps`` optimizer steps with every built-in plugin on: a metrics log every ``--log-every`` steps
(metrics.csv, events.jsonl, the progress line), an evaluation and a checkpoint every 1,000 steps (keeping
two), summary.json at the end. A plugin samples the process's resident memory at fixed steps. It prints the
peak RSS (``ru_maxrss``) and the current RSS at 1k steps and at the end, and their differences.

    python benchmarks/memory_growth.py                  # 20,000 steps (about a minute on 2 CPU cores)
    python benchmarks/memory_growth.py --steps 5000
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import csframework as csf

MB = 1024 * 1024


class Blobs(Dataset):
    def __init__(self, n: int = 1024, dim: int = 8, classes: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 2
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centres[self.y] + 0.5 * torch.randn(n, dim, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def mlp(dim: int = 8, hidden: int = 16, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes))


CONFIGS = {
    "model": "_target_: csframework.models.Supervised\nnet:\n  _target_: __main__.mlp\nloss: cross_entropy\n",
    "data": ("train:\n  _target_: __main__.Blobs\nval:\n  _target_: __main__.Blobs\n  n: 128\n  seed: 1\n"
             "batch_size: 16\n"),
}


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


class Sampler:
    name = "memory_sampler"

    def __init__(self, at):
        self.at = set(at)
        self.samples: dict[int, tuple[int, int, float]] = {}
        self.start = time.perf_counter()

    @csf.hookimpl(trylast=True)
    def on_train_batch_end(self, run):
        step = run.global_step
        if step in self.at and step not in self.samples:
            gc.collect()
            self.samples[step] = (peak_rss(), current_rss(), time.perf_counter() - self.start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    marks = sorted({1000, 2000, 5000, 10_000, args.steps} & set(range(1, args.steps + 1)))
    sampler = Sampler(marks)
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "conf")
        for group, text in CONFIGS.items():
            os.makedirs(os.path.join(conf, group))
            with open(os.path.join(conf, group, "bench.yaml"), "w") as f:
                f.write(text)
        cfg = csf.compose([
            "model=bench", "data=bench", f"loop.max_steps={args.steps}", f"loop.log_every={args.log_every}",
            "loop.eval_every=1000", "loop.eval_steps=4", "checkpoint.every_steps=1000", "checkpoint.keep_last=2",
            "optimizer=adamw", "optimizer.lr=0.01", "optimizer.schedule.warmup_steps=100",
        ], config_dir=conf)
        run = csf.Run(cfg, plugins=[sampler], output_dir=tmp)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # the console lines
            summary = run.fit()
    print(f"memory growth: {args.steps} steps of an 8-16-4 MLP, log every {args.log_every} steps, eval and "
          f"checkpoint every 1000; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'step':>7} {'peak RSS MB':>12} {'RSS MB':>8} {'seconds':>8}")
    for step in marks:
        peak, rss, seconds = sampler.samples[step]
        print(f"{step:>7} {peak / MB:>12.2f} {rss / MB:>8.2f} {seconds:>8.1f}")
    first, last = sampler.samples[marks[0]], sampler.samples[marks[-1]]
    print(f"peak RSS at {marks[0]} steps: {first[0] / MB:.2f} MB; at {marks[-1]} steps: {last[0] / MB:.2f} MB; "
          f"difference {(last[0] - first[0]) / MB:+.2f} MB (current RSS {(last[1] - first[1]) / MB:+.2f} MB)")
    assert summary["status"] == "completed", summary
    sys.stdout.flush()


if __name__ == "__main__":
    main()

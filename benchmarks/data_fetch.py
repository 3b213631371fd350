"""The batched data fast path (``csframework.batched``) alone: a framework loader over an in-memory
``TensorDataset`` (8192 x 784 floats, batch 64, shuffled) read whole epochs at a time, batched against
sample by sample (``__getitem__`` per sample and ``default_collate``), in CPU microseconds per batch. Its
effect on whole training steps is ``benchmarks.loop_overhead``'s figures.

    python -m benchmarks.data_fetch [--rounds N]
    python -m benchmarks.data_fetch --contestant fast      # one measurement, one JSON line
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from csframework.data import epoch_batches, make_loader

from . import harness
from .loop_overhead import SEED, dataset

BATCH = 64


def read(batched: bool, epochs: int = 4) -> dict:
    """The loader alone: CPU microseconds per batch over whole epochs (after one untimed epoch)."""
    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    loader = make_loader(dataset(), BATCH, shuffle=True, seed=SEED, num_workers=0, drop_last=True,
                         batched_fetch=batched)
    for _ in epoch_batches(loader, 0):
        pass
    batches, start = 0, time.process_time()
    for epoch in range(1, epochs + 1):
        for _ in epoch_batches(loader, epoch):
            batches += 1
    return {"cpu_us": 1e6 * (time.process_time() - start) / batches}


def figures(rounds: int) -> list[harness.Figure]:
    run = {name: harness.python("benchmarks.data_fetch", "--contestant", name) for name in ("fast", "plain")}
    results = harness.interleaved(run, rounds)
    return [harness.Figure(f"loader read, batched vs per-sample (TensorDataset 8192x784, batch {BATCH})",
                           "CPU us/batch", [r["cpu_us"] for r in results["fast"]], "per-sample + collate",
                           [r["cpu_us"] for r in results["plain"]], command="python -m benchmarks.data_fetch")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contestant", choices=["fast", "plain"])
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(read(args.contestant == "fast")))
    else:
        print(harness.table(figures(args.rounds)))


if __name__ == "__main__":
    sys.exit(main())

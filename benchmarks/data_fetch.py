"""The batched data fast path (``csframework.batched``) on an in-memory ``TensorDataset``.

The 784-256-256-10 MLP of ``loop_overhead`` (8192 samples, batch 64, AdamW, one CPU thread), every
contestant a fresh process, run interleaved by ``harness.interleaved``:

* ``premade``: a hand-written loop over batches made before the clock starts (the same batches, in the
  framework's order: both sides compute the very same numbers);
* ``fast`` / ``plain``: ``Run.fit()`` with the default plugins on (logging every 25 steps, progress,
  metrics, a checkpoint at the end), ``data.batched_fetch`` true / false, timed from the first batch to
  the end of the last step (a plugin's ``on_train_start`` / ``on_train_end``);
* ``read-fast`` / ``read-plain``: the loader alone, iterated over whole epochs (microseconds per batch).

    python -m benchmarks.data_fetch [--rounds N]
    python -m benchmarks.data_fetch --contestant fast --steps 600     # one measurement, one JSON line
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import csframework as csf
from csframework.data import epoch_batches, make_loader
from csframework.models import Supervised

from . import harness

IN, HIDDEN, CLASSES, SAMPLES, BATCH, SEED, LOG_EVERY = 784, 256, 10, 8192, 64, 0, 25
STEPS = 600


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def mlp():
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def per_step(start: tuple[float, float], end: tuple[float, float], steps: int) -> dict:
    return {"wall_ms": 1e3 * (end[0] - start[0]) / steps, "cpu_ms": 1e3 * (end[1] - start[1]) / steps}


def premade(steps: int) -> dict:
    """A hand-written loop over pre-made batches, in the order the framework's sampler reads them."""
    data = dataset()
    batches, epoch = [], 0
    while len(batches) < steps:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        batches += [[t.index_select(0, order[i:i + BATCH]) for t in data.tensors]
                    for i in range(0, SAMPLES - BATCH + 1, BATCH)]
        epoch += 1
    del batches[steps:]
    torch.manual_seed(SEED)
    model = Supervised(net=mlp(), loss="cross_entropy")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    model.train()
    losses, logged = [], float("nan")
    start = clock()
    for step, batch in enumerate(batches, 1):
        loss = model(batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % LOG_EVERY == 0:
            logged = float(torch.stack(losses).mean())
            losses.clear()
    if losses:  # the framework logs the steps since the last log when it ends
        logged = float(torch.stack(losses).mean())
    return per_step(start, clock(), steps) | {"loss": logged}


class StepTimer:
    """First batch to the end of the last step, from inside the run."""

    name = "step_timer"

    @csf.hookimpl(tryfirst=True)
    def on_train_start(self):
        self.start = clock()

    @csf.hookimpl(tryfirst=True)
    def on_train_end(self):
        self.end = clock()


def framework(steps: int, batched: bool) -> dict:
    """``Run.fit()`` with the default plugins, ``data.batched_fetch=batched``."""
    cfg = csf.compose(["optimizer=adamw", "optimizer.lr=1e-3", "optimizer.weight_decay=0.01",
                       "optimizer.max_grad_norm=null", "optimizer.schedule.name=constant",
                       "optimizer.schedule.warmup_steps=0", "optimizer.schedule.min_lr=0",
                       f"loop.max_steps={steps}", "loop.eval_every=null", f"loop.log_every={LOG_EVERY}",
                       f"data.batch_size={BATCH}", "data.num_workers=0", "data.shuffle=true",
                       f"data.batched_fetch={str(batched).lower()}", f"seed={SEED}"])
    cfg.model = {"_target_": "csframework.models.Supervised", "loss": "cross_entropy",
                 "net": {"_target_": f"{__name__}.mlp"}}
    cfg.data.train = {"_target_": f"{__name__}.dataset"}
    cfg.data.val = None
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="csf-bench-") as out, contextlib.redirect_stderr(io.StringIO()):
        summary = csf.Run(cfg, plugins=[timer], output_dir=out).fit()
    assert summary["status"] == "completed" and summary["global_step"] == steps
    return per_step(timer.start, timer.end, steps) | {"loss": summary["metrics"]["train/loss"]}


def read(batched: bool, epochs: int = 4) -> dict:
    """The loader alone: microseconds per batch over whole epochs (after one untimed epoch)."""
    loader = make_loader(dataset(), BATCH, shuffle=True, seed=SEED, num_workers=0, drop_last=True,
                         batched_fetch=batched)
    for _ in epoch_batches(loader, 0):
        pass
    batches, start = 0, clock()
    for epoch in range(1, epochs + 1):
        for _ in epoch_batches(loader, epoch):
            batches += 1
    end = clock()
    return {"wall_us": 1e6 * (end[0] - start[0]) / batches, "cpu_us": 1e6 * (end[1] - start[1]) / batches}


def contestant(name: str, steps: int) -> dict:
    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    if name == "premade":
        return premade(steps)
    if name in ("fast", "plain"):
        return framework(steps, name == "fast")
    return read(name == "read-fast")


def figures(rounds: int, steps: int = STEPS) -> list[harness.Figure]:
    command = f"python -m benchmarks.data_fetch --rounds {rounds}"
    run = {name: harness.python("benchmarks.data_fetch", "--contestant", name, "--steps", str(steps))
           for name in ("premade", "fast", "plain", "read-fast", "read-plain")}
    steps_results = harness.interleaved({k: run[k] for k in ("premade", "fast", "plain")}, rounds)
    read_results = harness.interleaved({k: run[k] for k in ("read-fast", "read-plain")}, rounds)
    cpu = {k: [r["cpu_ms"] for r in v] for k, v in steps_results.items()}
    losses = {k: {r["loss"] for r in v} for k, v in steps_results.items()}
    if len(losses["premade"] | losses["fast"] | losses["plain"]) != 1:  # not the same work: no comparison
        raise RuntimeError(f"the contestants' last logged losses differ: {losses}")
    mlp_name = f"{IN}-{HIDDEN}-{HIDDEN}-{CLASSES} MLP, TensorDataset, batch {BATCH}"
    return [
        harness.Figure(f"steps, batched fast path vs pre-made batches ({mlp_name})", "CPU ms/step", cpu["fast"],
                       "hand loop, pre-made batches", cpu["premade"], "<= 1.05x", 1.05, command),
        harness.Figure(f"steps, per-sample path vs pre-made batches ({mlp_name})", "CPU ms/step", cpu["plain"],
                       "hand loop, pre-made batches", cpu["premade"], command=command),
        harness.Figure(f"loader read, batched vs per-sample (TensorDataset {SAMPLES}x{IN}, batch {BATCH})",
                       "CPU us/batch", [r["cpu_us"] for r in read_results["read-fast"]], "per-sample + collate",
                       [r["cpu_us"] for r in read_results["read-plain"]], command=command),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--contestant", choices=["premade", "fast", "plain", "read-fast", "read-plain"])
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args.contestant, args.steps)))
        return
    print(harness.table(figures(args.rounds, args.steps)))


if __name__ == "__main__":
    sys.exit(main())

"""Loop overhead: csframework's ``Run.fit()`` against a hand-written PyTorch loop doing the same work.

Same process, same model class and initial weights (``Supervised`` around a 784-256-256-10 MLP), the same
in-memory dataset object in the same shuffled order, AdamW with the same settings, CPU with one thread:
both loops compute the very same numbers (the last logged losses printed agree). The framework runs with
its default plugins on (validation, logging, progress, metrics, checkpoint: a log line every
``--log-every`` steps, metrics.csv, events.jsonl, one checkpoint at the end, summary.json), evaluation
off, writing into a temporary directory. The two loops alternate for ``--rounds`` rounds after one
untimed warm-up each; the medians, and the median of the per-round ratios, are reported.

Two figures per side:
* ``fit``: the whole ``Run.fit()`` (start-up hooks, every step, the final checkpoint, summary) against the
  whole hand-written loop, divided by the steps;
* ``steps``: the training steps only (first batch to last step), measured inside the run by a plugin.

    python benchmarks/loop_overhead.py                 # defaults: 1000 steps x 7 rounds, batch 64
    python benchmarks/loop_overhead.py --profile       # and a cProfile of one framework fit
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import csframework as csf
from csframework.models import Supervised

IN, HIDDEN, CLASSES = 784, 256, 10
SEED = 0
_DATASET: TensorDataset | None = None


def shared_dataset(n: int = 8192) -> TensorDataset:
    """One in-memory dataset for both loops (the framework's ``data.train._target_`` returns this object)."""
    global _DATASET
    if _DATASET is None or len(_DATASET) != n:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(n, IN, generator=g)
        y = (x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)  # learnable labels
        _DATASET = TensorDataset(x, y)
    return _DATASET


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


# -- the hand-written loop --------------------------------------------------------------------------------------
def clock() -> tuple[float, float]:
    """(wall, CPU) seconds: CPU time of this process is less disturbed by other work on the machine."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = clock()
    return wall - start[0], cpu - start[1]


def hand_written(steps: int, batch_size: int, lr: float, log_every: int) -> tuple[tuple[float, float], float]:
    """A typical plain PyTorch loop; returns ((wall, CPU) seconds, last logged loss)."""
    torch.manual_seed(SEED)
    model = Supervised(net=mlp(), loss="cross_entropy")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    dataset = shared_dataset()
    model.train()
    start = clock()
    step, epoch, losses, logged = 0, 0, [], float("nan")
    while step < steps:
        # the framework's shuffle (a permutation seeded by seed and epoch), so that both loops compute the
        # very same numbers: two training trajectories could cost differently (denormals ...)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        epoch += 1
        for batch in DataLoader(dataset, batch_size=batch_size, sampler=order.tolist(), drop_last=True):
            loss = model(batch)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            step += 1
            if step % log_every == 0:
                logged = float(torch.stack(losses).mean())
                losses.clear()
            if step == steps:
                break
    return since(start), logged


# -- the framework ------------------------------------------------------------------------------------------------
class StepTimer:
    """Times the training steps from inside the run: first batch to the end of the last step."""

    name = "step_timer"

    @csf.hookimpl(tryfirst=True)
    def on_train_start(self):
        self.start = clock()

    @csf.hookimpl(tryfirst=True)
    def on_train_end(self):
        self.seconds = since(self.start)


def framework_config(steps: int, batch_size: int, lr: float, log_every: int) -> csf.RunConfig:
    cfg = csf.compose(["optimizer=adamw", f"optimizer.lr={lr}", "optimizer.weight_decay=0.01",
                       "optimizer.max_grad_norm=null", "optimizer.schedule.name=constant",
                       "optimizer.schedule.warmup_steps=0", "optimizer.schedule.min_lr=0",
                       f"loop.max_steps={steps}", "loop.eval_every=null", f"loop.log_every={log_every}",
                       f"data.batch_size={batch_size}", "data.num_workers=0", "data.shuffle=true",
                       f"seed={SEED}"])
    cfg.model = {"_target_": "csframework.models.Supervised", "loss": "cross_entropy",
                 "net": {"_target_": f"{__name__}.mlp"}}
    cfg.data.train = {"_target_": f"{__name__}.shared_dataset"}
    cfg.data.val = None
    return cfg


BUILTINS = ["validation", "logging", "progress", "metrics", "checkpoint"]
STEP_HOOKS = ["on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_train_batch_end"]
#: --ablate: the framework with parts taken away (diagnosis only: the last two reach into the run)
ABLATIONS = {
    "built-in plugins off": dict(disable=BUILTINS),
    "+ no LR-scheduler step": dict(disable=BUILTINS, no_scheduler=True),
    "+ no per-step hook calls": dict(disable=BUILTINS, no_scheduler=True, no_hooks=True),
}


class _NoScheduler:
    def step(self):
        pass


def framework(cfg: csf.RunConfig, workdir: Path, log: io.TextIOBase, disable=(), no_scheduler=False,
              no_hooks=False):
    """``Run.fit()`` with the default plugins; returns ((wall, CPU) seconds of the fit, (wall, CPU)
    seconds of the steps, last logged loss)."""
    timer = StepTimer()
    if disable:
        cfg = copy.deepcopy(cfg)
        cfg.plugins.disable = list(disable)
    run = csf.Run(cfg, plugins=[timer], output_dir=tempfile.mkdtemp(dir=workdir))
    if no_scheduler:
        run.scheduler = _NoScheduler()
    if no_hooks:
        for name in STEP_HOOKS:
            setattr(run.hooks, name, lambda **kwargs: None)
    with contextlib.redirect_stderr(log):  # the run's console output, as a batch job's log file
        start = clock()
        summary = run.fit()
        seconds = since(start)
    assert summary["status"] == "completed" and summary["global_step"] == cfg.loop.max_steps
    return seconds, timer.seconds, summary["metrics"].get("train/loss")


def profile_framework(cfg: csf.RunConfig, workdir: Path, log: io.TextIOBase, top: int = 30) -> str:
    run = csf.Run(cfg, output_dir=tempfile.mkdtemp(dir=workdir))
    profiler = cProfile.Profile()
    with contextlib.redirect_stderr(log):
        profiler.enable()
        run.fit()
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of one framework fit")
    parser.add_argument("--ablate", action="store_true",
                        help="also time the framework with plugins, the LR-scheduler step and the hook calls removed")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    shared_dataset()
    cfg = framework_config(args.steps, args.batch_size, args.lr, args.log_every)
    hand, fit_times, step_times, hand_loss, fw_loss = [], [], [], None, None
    with tempfile.TemporaryDirectory(prefix="csf-bench-") as tmp:
        workdir = Path(tmp)
        with open(workdir / "console.log", "w") as log:
            hand_written(args.steps, args.batch_size, args.lr, args.log_every)  # warm-up, untimed
            framework(cfg, workdir, log)
            for i in range(args.rounds):
                order = (0, 1) if i % 2 == 0 else (1, 0)  # alternate who goes first
                for which in order:
                    if which == 0:
                        seconds, hand_loss = hand_written(args.steps, args.batch_size, args.lr, args.log_every)
                        hand.append(seconds)
                    else:
                        fit_s, step_s, fw_loss = framework(cfg, workdir, log)
                        fit_times.append(fit_s)
                        step_times.append(step_s)
            report = None
            if args.profile:
                report = profile_framework(cfg, workdir, log)
            ablated = {}
            if args.ablate:
                ablated = {"hand-written loop": []} | {name: [] for name in ABLATIONS}
                for i in range(args.rounds):
                    names = list(ablated) if i % 2 == 0 else list(reversed(ablated))
                    for name in names:
                        if name == "hand-written loop":
                            ablated[name].append(hand_written(args.steps, args.batch_size, args.lr,
                                                              args.log_every)[0][1])
                        else:
                            ablated[name].append(framework(cfg, workdir, log, **ABLATIONS[name])[1][1])

    n = args.steps

    def ms(pairs, i):  # median ms per step of the wall (i=0) or CPU (i=1) times
        return 1e3 * statistics.median(p[i] for p in pairs) / n

    result = {}
    for i, kind in enumerate(("wall", "cpu")):
        result[f"hand_{kind}_ms"] = ms(hand, i)
        result[f"fit_{kind}_ms"] = ms(fit_times, i)
        result[f"steps_{kind}_ms"] = ms(step_times, i)
        result[f"fit_{kind}_ratio"] = result[f"fit_{kind}_ms"] / result[f"hand_{kind}_ms"]
        result[f"steps_{kind}_ratio"] = result[f"steps_{kind}_ms"] / result[f"hand_{kind}_ms"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); model {IN}-{HIDDEN}-{HIDDEN}-{CLASSES} "
          f"MLP, AdamW, batch {args.batch_size}, {n} steps x {args.rounds} rounds (median ms/step), "
          f"framework log_every={args.log_every}")
    print(f"  {'':26s} {'wall':>8s} {'ratio':>7s}   {'CPU':>8s} {'ratio':>7s}")
    rows = (("hand-written loop", "hand"), ("csframework fit()", "fit"), ("csframework steps only", "steps"))
    for label, key in rows:
        row = f"  {label:26s} {result[key + '_wall_ms']:8.3f}"
        row += f" {result[key + '_wall_ratio']:7.3f}" if key != "hand" else " " * 8
        row += f"   {result[key + '_cpu_ms']:8.3f}"
        row += f" {result[key + '_cpu_ratio']:7.3f}" if key != "hand" else ""
        print(row)
    print(f"  last logged train loss: hand-written {hand_loss:.4f}, csframework {fw_loss:.4f}")
    print("  per round, wall ms/step, hand: " + " ".join(f"{1e3 * t[0] / n:.3f}" for t in hand))
    print("  per round, wall ms/step, fit:  " + " ".join(f"{1e3 * t[0] / n:.3f}" for t in fit_times))
    print("  (fit: the whole Run.fit() incl. start-up hooks, the final checkpoint and summary; steps only: first "
          "batch to last step)")
    # each round's two loops ran back to back: the median of the per-round ratios is robust to the
    # machine's speed drifting between rounds, which the ratio of the medians is not
    for i, kind in enumerate(("wall", "cpu")):
        result[f"fit_{kind}_paired"] = statistics.median(f[i] / h[i] for h, f in zip(hand, fit_times))
        result[f"steps_{kind}_paired"] = statistics.median(s[i] / h[i] for h, s in zip(hand, step_times))
    print(f"  paired (median of the per-round ratios): fit {result['fit_wall_paired']:.3f} wall, "
          f"{result['fit_cpu_paired']:.3f} CPU; steps only {result['steps_wall_paired']:.3f} wall, "
          f"{result['steps_cpu_paired']:.3f} CPU")
    worst = max(result["fit_wall_paired"], result["fit_cpu_paired"])
    verdict = "within" if worst <= 1.05 else "OVER"
    print(f"  fit() overhead, paired: {100 * (result['fit_wall_paired'] - 1):+.1f}% wall, "
          f"{100 * (result['fit_cpu_paired'] - 1):+.1f}% CPU ({verdict} the 5% target)")
    if ablated:
        base = statistics.median(ablated["hand-written loop"])
        print("  ablation, training steps only, CPU (median of the rounds):")
        for name, times in ablated.items():
            t = statistics.median(times)
            print(f"    {name:28s} {1e3 * t / n:8.3f} ms/step  {1e6 * (t - base) / n:+7.1f} us/step  "
                  f"ratio {t / base:.3f}")
    if report:
        print(report)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

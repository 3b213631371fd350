"""Evaluation: ``Run.validate()`` against a hand-written ``torch.inference_mode()`` evaluation loop.

Two contestants, each a fresh process per round, one torch thread, on the same work: ``Supervised`` around
the 784-256-256-10 MLP of ``benchmarks.loop_overhead`` (the same initial weights: seed 0), evaluated on its
in-memory dataset (``dataset``, 8,192 samples) in batches of 64, through a ``DataLoader`` with the
same settings on both sides (in order, no workers, no pinning):

* ``hand``: ``model.eval()``, then ``with torch.inference_mode(): for batch in loader: out = model(batch);
  loss_sum += out["loss"]; accuracy_sum += out["accuracy"]``, and the means: the two figures the framework
  reports (``val/loss``, ``val/accuracy``; the model computes both on either side);
* ``csframework``: ``Run.validate()`` with the default plugins (the framework's loader, per-batch hooks,
  ``val/*`` means of every scalar output, the output collector off, as by default).

Each process evaluates ``--passes`` times after one untimed pass and reports the median CPU and wall
seconds per pass; csframework's pass is timed inside the run, from the first ``on_eval_start`` to the last
``on_eval_end`` (the evaluation itself; not ``validate``'s set-up and tear-down, ``on_fit_start`` and
``on_fit_end``). The figure is the CPU time (the process's, one thread): on a shared machine it is far
less disturbed by other work than the wall time, which is printed beside it. Both sides print the mean
loss and accuracy, which must agree.

    python -m benchmarks.evaluation                   # 7 rounds
    python -m benchmarks.evaluation --rounds 3
    python -m benchmarks.evaluation --contestant hand # one measurement, as JSON
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader

import csframework as csf
from benchmarks import harness
from benchmarks.loop_overhead import SEED, dataset, mlp
from csframework.models import Supervised

MODULE = "benchmarks.evaluation"  #: this module (``__name__`` is ``__main__`` under ``python -m``)
BATCH = 64
PASSES = 10


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = clock()
    return wall - start[0], cpu - start[1]


def medians(times: list[tuple[float, float]]) -> dict:
    return {"wall_s": statistics.median(t[0] for t in times), "cpu_s": statistics.median(t[1] for t in times)}


def hand_pass() -> callable:
    """The hand-written evaluation; returns a function that runs one pass and returns the mean loss and
    accuracy."""
    torch.manual_seed(SEED)
    model = Supervised(net=mlp(), loss="cross_entropy")
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False, num_workers=0)

    def one_pass() -> float:
        model.eval()
        with torch.inference_mode():
            loss_sum, accuracy_sum, count = torch.zeros(()), torch.zeros(()), 0
            for batch in loader:
                out = model(batch)
                loss_sum += out["loss"]
                accuracy_sum += out["accuracy"]
                count += 1
            return float(loss_sum / count), float(accuracy_sum / count)

    one_pass.batches = len(loader)
    return one_pass


def hand(passes: int) -> dict:
    """The hand-written loop ``passes + 1`` times; the median seconds per pass (the first one not counted)
    and the mean loss and accuracy."""
    one_pass = hand_pass()
    times = []
    for _ in range(passes + 1):
        start = clock()
        loss, accuracy = one_pass()
        times.append(since(start))
    return medians(times[1:]) | {"loss": loss, "accuracy": accuracy, "batches": one_pass.batches}


class PassTimer:
    """Times each evaluation pass from inside the run (first ``on_eval_start`` to last ``on_eval_end``)."""

    name = "pass_timer"

    def __init__(self):
        self.times: list[tuple[float, float]] = []

    @csf.hookimpl(tryfirst=True)
    def on_eval_start(self):
        self.start = clock()

    @csf.hookimpl(trylast=True)
    def on_eval_end(self):
        self.times.append(since(self.start))


def framework_run(timer: PassTimer, output_dir: str) -> csf.Run:
    """The run ``Run.validate()`` evaluates: the same model, weights, dataset and batches as ``hand_pass``."""
    # the hand-written loop's per-sample DataLoader (not the batched fast path): the same reads on both sides
    cfg = csf.compose(["data.num_workers=0", f"data.batch_size={BATCH}", "loop.eval_steps=null",
                       "data.batched_fetch=false", f"seed={SEED}", "loop.max_steps=1"])
    cfg.model = {"_target_": "csframework.models.Supervised", "loss": "cross_entropy",
                 "net": {"_target_": "benchmarks.loop_overhead.mlp"}}
    cfg.data.train = {"_target_": "benchmarks.loop_overhead.dataset"}
    cfg.data.val = {"_target_": "benchmarks.loop_overhead.dataset"}
    return csf.Run(cfg, plugins=[timer], output_dir=output_dir)


def framework(passes: int) -> dict:
    """``Run.validate()`` ``passes + 1`` times on one run; the median seconds per pass, ``val/loss`` and
    ``val/accuracy``."""
    timer = PassTimer()
    with tempfile.TemporaryDirectory(prefix="csf-eval-") as tmp:
        run = framework_run(timer, tmp)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # the console lines
            for _ in range(passes + 1):
                summary = run.validate()
    if summary["status"] != "completed" or len(timer.times) != passes + 1:
        raise RuntimeError(f"validate did not complete {passes + 1} evaluations: {summary}")
    return medians(timer.times[1:]) | {"loss": summary["metrics"]["val/loss"],
                                       "accuracy": summary["metrics"]["val/accuracy"], "batches": len(run.val_loader)}


def same_process(passes: int) -> dict:
    """Diagnosis: both sides in this one process, pass after pass (alternating who goes first), CPU time;
    without the differences between processes a shared machine adds, a smaller overhead shows. Returns the
    ratio of the fastest passes and the median of the per-pair ratios."""
    one_hand, timer = hand_pass(), PassTimer()
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="csf-eval-") as tmp:
        run = framework_run(timer, tmp)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            run.validate()
            one_hand()
            for i in range(passes):
                for side in ("hand", "csframework") if i % 2 == 0 else ("csframework", "hand"):
                    if side == "hand":
                        start = clock()
                        one_hand()
                        theirs.append(since(start)[1])
                    else:
                        run.validate()
                        ours.append(timer.times[-1][1])
    return {"fastest": min(ours) / min(theirs), "paired": statistics.median(o / t for o, t in zip(ours, theirs))}


def measure(rounds: int, passes: int = PASSES) -> dict[str, list[dict]]:
    contestants = {name: harness.python(MODULE, "--contestant", name, "--passes", str(passes))
                   for name in ("hand", "csframework")}
    return harness.interleaved(contestants, rounds, harness.contestant_env())


def figures(rounds: int, passes: int = PASSES, results: dict | None = None) -> list[harness.Figure]:
    """Seconds per evaluation pass, ``Run.validate()`` over the hand-written ``inference_mode`` loop."""
    results = results or measure(rounds, passes)
    return [harness.Figure(
        name="evaluation pass, CPU time (784-256-256-10 MLP, 128 batches)", unit="ms/pass",
        samples=[1e3 * r["cpu_s"] for r in results["csframework"]],
        baseline="hand-written inference_mode loop", baseline_samples=[1e3 * r["cpu_s"] for r in results["hand"]],
        target="<= 1.02x", limit=1.02, command=f"python -m {MODULE} --rounds {rounds}")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--passes", type=int, default=PASSES, help="timed passes per process (median)")
    parser.add_argument("--contestant", choices=["hand", "csframework"], help="one measurement, as JSON")
    parser.add_argument("--same-process", type=int, default=0, metavar="PASSES",
                        help="also time both sides in one process, PASSES passes each, alternating (diagnosis)")
    args = parser.parse_args(argv)
    if args.contestant:
        torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
        print(json.dumps((hand if args.contestant == "hand" else framework)(args.passes)))
        return
    results = measure(args.rounds, args.passes)
    print(harness.table(figures(args.rounds, args.passes, results)))
    wall = statistics.median(c["wall_s"] / h["wall_s"] for c, h in zip(results["csframework"], results["hand"]))
    print(f"\nwall time: csframework / hand-written, median of the per-round ratios: {wall:.3f}x")
    means = {name: {(round(r["loss"], 6), round(r["accuracy"], 6)) for r in rs} for name, rs in results.items()}
    print(f"mean (loss, accuracy): hand-written {means['hand']}, csframework {means['csframework']}; "
          f"{results['hand'][0]['batches']} batches of {BATCH} per pass, median of {args.passes} passes per round")
    if args.same_process:
        env = harness.contestant_env()
        os.environ.update({k: env[k] for k in ("CSF_BENCH_THREADS", "CSFRAMEWORK_PLUGINS_AUTOLOAD")})
        torch.set_num_threads(int(env["CSF_BENCH_THREADS"]))
        both = same_process(args.same_process)
        print(f"same process, {args.same_process} passes each, CPU time: csframework / hand-written "
              f"{both['fastest']:.3f}x (fastest passes), {both['paired']:.3f}x (median of the pairs)")


if __name__ == "__main__":
    main()

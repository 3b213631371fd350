"""Memory growth: does a long run hold more memory the more steps it takes?

One contestant, a fresh process per round: a tiny model (an 8-16-4 MLP on an in-memory blob dataset,
batch 16, AdamW, dropout) trained for ``--steps`` optimizer steps (20,000) with every built-in plugin on:
a metrics log every 10 steps (metrics.csv, events.jsonl, the progress line), an evaluation of the whole
validation set every 1,000 steps with the output collector on (``loop.collect=[preds,labels]``, saved to
``eval_outputs/step_<N>.safetensors`` by ``loop.collect_save``), a checkpoint every 1,000 steps (keeping
two), summary.json at the end. A plugin reads the process's resident memory (``/proc/self/statm``, after a
``gc.collect()``) at fixed steps, after that step's evaluation and checkpoint.

The figure is the RSS growth from the warm point, step 1,000, to the last step. Why not from step 0: the
first thousand steps allocate what a run holds once and for good (the allocator's arenas reach their
working size, autograd's and the optimizer's buffers, the first evaluation imports safetensors and builds
the collector's buffers, the first checkpoint imports and sizes its writer's buffers, the logging plugins
open their files); that is a fixed cost, not growth. Everything after it is the same work repeated
nineteen times, so memory a run keeps per step, per log, per evaluation or per checkpoint shows as growth
from there to the end. The peak RSS (``ru_maxrss``) growth over the same span is printed beside it.

    python -m benchmarks.memory_growth                    # 3 rounds of 20,000 steps
    python -m benchmarks.memory_growth --rounds 1 --steps 5000
    python -m benchmarks.memory_growth --contestant csframework   # one measurement, as JSON
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import csframework as csf
from benchmarks import harness

MB = 1024 * 1024
STEPS = 20_000
WARM = 1_000  #: the step growth is measured from (see the module docstring)
EVERY = 1_000  #: evaluation and checkpoint interval
MODULE = "benchmarks.memory_growth"  #: this module (``__name__`` is ``__main__`` under ``python -m``)


class Blobs(Dataset):
    """``n`` points around ``classes`` Gaussian centres in ``dim`` dimensions (labels: the centre)."""

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
    "model": f"_target_: csframework.models.Supervised\nnet:\n  _target_: {MODULE}.mlp\nloss: cross_entropy\n",
    "data": (f"train:\n  _target_: {MODULE}.Blobs\nval:\n  _target_: {MODULE}.Blobs\n  n: 128\n  seed: 1\n"
             "batch_size: 16\n"),
}


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


class Sampler:
    """Reads the RSS at the steps ``at``, after everything else that runs at that step (trylast)."""

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


def contestant(steps: int, log_every: int) -> dict:
    """One run of ``steps`` steps; the RSS at the marks, and the growth from ``WARM`` to the end."""
    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    warm = min(WARM, steps)
    marks = sorted({warm, 2_000, 5_000, 10_000, steps} & set(range(warm, steps + 1)))
    sampler = Sampler(marks)
    with tempfile.TemporaryDirectory(prefix="csf-mem-") as tmp:
        conf = os.path.join(tmp, "conf")
        for group, text in CONFIGS.items():
            os.makedirs(os.path.join(conf, group))
            with open(os.path.join(conf, group, "bench.yaml"), "w") as f:
                f.write(text)
        cfg = csf.compose([
            "model=bench", "data=bench", f"loop.max_steps={steps}", f"loop.log_every={log_every}",
            f"loop.eval_every={EVERY}", "loop.eval_steps=null", "loop.collect=[preds,labels]",
            "loop.collect_save=true", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "optimizer=adamw", "optimizer.lr=0.01", "optimizer.schedule.warmup_steps=100",
        ], config_dir=conf)
        run = csf.Run(cfg, plugins=[sampler], output_dir=os.path.join(tmp, "run"))
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # the console lines
            summary = run.fit()
        saved = len(os.listdir(os.path.join(tmp, "run", "eval_outputs")))
    if summary["status"] != "completed" or saved != -(-steps // EVERY):  # and one at the end
        raise RuntimeError(f"the run did not do its work: {summary['status']}, {saved} collected evaluations saved")
    first, last = sampler.samples[marks[0]], sampler.samples[marks[-1]]
    return {"steps": steps, "warm_step": marks[0],
            "growth_mb": (last[1] - first[1]) / MB, "peak_growth_mb": (last[0] - first[0]) / MB,
            "marks": {str(s): {"peak_mb": p / MB, "rss_mb": r / MB, "seconds": t}
                      for s, (p, r, t) in sampler.samples.items()}}


def command(steps: int = STEPS, log_every: int = 10) -> list[str]:
    return harness.python(MODULE, "--contestant", "csframework", "--steps", str(steps),
                          "--log-every", str(log_every))


def measure(rounds: int, steps: int = STEPS, log_every: int = 10) -> dict[str, list[dict]]:
    return harness.interleaved({"csframework": command(steps, log_every)}, rounds, harness.contestant_env())


def figures(rounds: int, steps: int = STEPS, results: dict | None = None) -> list[harness.Figure]:
    """The RSS growth from step 1,000 to step ``steps``, one fresh run per round."""
    results = results or measure(rounds, steps)
    label = f"{steps // 1000}k" if steps % 1000 == 0 else str(steps)
    return [harness.Figure(
        name=f"RSS growth over {label} steps", unit="MB", kind="value", limit=5.0, target="< 5 MB",
        samples=[r["growth_mb"] for r in results["csframework"]],
        command=f"python -m {MODULE} --rounds {rounds}" + (f" --steps {steps}" if steps != STEPS else ""))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--contestant", choices=["csframework"], help="run one measurement, print it as JSON")
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args.steps, args.log_every)))
        return
    results = measure(args.rounds, args.steps, args.log_every)
    print(harness.table(figures(args.rounds, args.steps, results)))
    print(f"\nRSS (after gc.collect) at each mark, MB, median of {args.rounds} round(s); the first mark is the "
          "warm point:")
    print(f"{'step':>7} {'RSS':>8} {'peak RSS':>9} {'seconds':>8}")
    for step in results["csframework"][0]["marks"]:
        rows = [r["marks"][step] for r in results["csframework"]]
        print(f"{step:>7} {statistics.median(r['rss_mb'] for r in rows):8.2f} "
              f"{statistics.median(r['peak_mb'] for r in rows):9.2f} "
              f"{statistics.median(r['seconds'] for r in rows):8.1f}")
    print("growth per round, MB (RSS / peak RSS): " + ", ".join(
        f"{r['growth_mb']:+.2f} / {r['peak_growth_mb']:+.2f}" for r in results["csframework"]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

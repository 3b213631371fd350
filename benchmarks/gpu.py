"""GPU figures (CUDA only): csframework's step on ``device=gpu`` against a hand-written CUDA loop, and bfloat16
against float32 on the embedded default transformer.

Each contestant is a fresh process that trains from the same initial weights with AdamW (no clipping, a
constant rate) on the same batches in the framework's shuffled order, and reports the wall time of its
training steps (first batch to last step, the device synchronised at both ends: CUDA work is asynchronous,
so the CPU time of a process says nothing about it).

* ``hand``: a plain loop over batches made before the clock starts and held in pinned memory, each copied to
  the GPU with ``non_blocking=True`` as its step begins (the floor a careful hand-written loop reaches), a
  loss read every ``log_every`` steps, ``torch.autocast(dtype=torch.bfloat16)`` for ``bfloat16``;
* ``framework``: ``Run.fit()`` with ``device=gpu`` and the default plugins on (logging, progress, metrics, a
  checkpoint at the end), reading the dataset through its batched fetch into pinned memory.

Models: ``transformer``, the embedded default (``TinyTransformer``: 2 layers, d_model 128, 64-byte windows,
batch 32, the Python standard library's text); ``transformer-large``, the same class sized to keep the GPU
busy (8 layers, d_model 1024, 512-byte windows, batch 16), where bfloat16's matrix units show; ``mlp2``,
``benchmarks.loop_overhead``'s 784-256-256-10 MLP (batch 64), whose step is a handful of tiny kernels.

    python -m benchmarks.gpu [--rounds N]           # every figure (needs CUDA)
    python -m benchmarks.gpu --contestant framework --model transformer --precision bfloat16
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

import csframework as csf
from benchmarks import harness, loop_overhead
from benchmarks.loop_overhead import LOG_EVERY, LR, SEED, epoch_order

#: name: (model overrides, batch size, warm-up steps, timed steps)
MODELS = {
    "transformer": ([], 32, 50, 500),
    "transformer-large": (["model.n_layers=8", "model.d_model=1024", "model.n_heads=16", "model.block_size=512"],
                          16, 10, 60),
    "mlp2": ([], 64, 50, 500),
}
#: CSF_BENCH_DEVICE=cpu runs the contestants on the CPU (to check this module where there is no GPU).
DEVICE = os.environ.get("CSF_BENCH_DEVICE", "gpu")


def cuda() -> bool:
    return DEVICE == "gpu"


def torch_device() -> torch.device:
    return torch.device("cuda" if cuda() else "cpu")


def synchronize() -> None:
    if cuda():
        torch.cuda.synchronize()


def sizes(model: str) -> dict:
    """The ``TinyTransformer`` keyword arguments of ``model`` (its overrides over the embedded default's)."""
    from csframework.defaults import TinyTransformer  # noqa: F401 (the class the config names)

    kwargs = {"vocab_size": 256, "block_size": 64, "d_model": 128, "n_layers": 2, "n_heads": 4, "dropout": 0.0}
    for override in MODELS[model][0]:
        key, value = override.removeprefix("model.").split("=")
        kwargs[key] = int(value)
    return kwargs


# -- the hand-written loop ----------------------------------------------------------------------------------------
def build(model: str):
    """(model, per-epoch batch maker) exactly as the framework builds them from the same seed."""
    from csframework.defaults import StdlibText, TinyTransformer
    from csframework.models import Supervised

    torch.manual_seed(SEED)
    batch_size = MODELS[model][1]
    if model == "mlp2":
        os.environ["CSF_BENCH_MODEL"] = "mlp2"
        net = Supervised(net=loop_overhead.mlp(), loss="cross_entropy")
        x, y = loop_overhead.dataset().tensors

        def read(indices):
            return [x[indices], y[indices]]
        size = len(x)
    else:
        kwargs = sizes(model)
        net = TinyTransformer(**kwargs)
        text = StdlibText("train", block_size=kwargs["block_size"], num_chars=600_000)
        read, size = text.__getbatch__, len(text)

    def batches(epoch: int) -> list[list[torch.Tensor]]:
        order = torch.tensor(epoch_order(size, epoch))
        made = [read(i) for i in order[: size // batch_size * batch_size].split(batch_size)]
        return [[t.pin_memory() for t in b] for b in made] if cuda() else made
    return net, batches, size // batch_size


def hand_written(model: str, precision: str, steps: int, marks: list | None = None) -> tuple[float, float]:
    """A careful plain CUDA loop; returns (wall seconds of the steps, last logged loss). ``marks``: gets the
    host clock at the end of each step (``--profile``)."""
    device = torch_device()
    net, make_batches, per_epoch = build(model)
    net.to(device).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    epochs = [make_batches(e) for e in range(-(-steps // per_epoch))]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bfloat16"
                else contextlib.nullcontext())
    step, losses, logged = 0, [], float("nan")
    synchronize()
    start = time.perf_counter()
    for batches in epochs:
        for batch in batches:
            batch = [t.to(device, non_blocking=True) for t in batch]
            with autocast:
                loss = net(batch)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            step += 1
            if marks is not None:
                marks.append(time.perf_counter())
            if step % LOG_EVERY == 0:
                logged = float(torch.stack(losses).mean())  # the one synchronisation, as the framework's
                losses.clear()
                print(f"step {step} loss {logged:.4f}", file=sys.stderr)
            if step == steps:
                break
        if step == steps:
            break
    if losses:
        logged = float(torch.stack(losses).mean())
    synchronize()
    return time.perf_counter() - start, logged


# -- the framework ------------------------------------------------------------------------------------------------
class WallTimer:
    """First batch (or the end of step ``skip``: a compiled run's first steps compile) to the end of the last
    step, the device synchronised at both ends."""

    name = "wall_timer"

    def __init__(self, skip: int = 0):
        self.skip = skip

    @csf.hookimpl(tryfirst=True)
    def on_train_start(self):
        synchronize()
        self.start = time.perf_counter()

    @csf.hookimpl(tryfirst=True)
    def on_train_step_end(self, step):
        if step == self.skip:
            synchronize()
            self.start = time.perf_counter()

    @csf.hookimpl(tryfirst=True)
    def on_train_end(self):
        synchronize()
        self.seconds = time.perf_counter() - self.start


class StepMarks:
    """The host clock at the end of each step (``--profile``)."""

    name = "step_marks"

    def __init__(self, marks: list):
        self.marks = marks

    @csf.hookimpl(tryfirst=True)
    def on_train_step_end(self):
        self.marks.append(time.perf_counter())


#: ``--compile MODE``: the framework contestant with ``backend.compile=true backend.compile_mode=MODE``, timed
#: after its first COMPILE_SKIP steps (the compiles; their cost is in summary.json's compile block)
COMPILE_SKIP = 10
#: the compiled rows of ``figures``: CUDA graphs, what a launch-bound step needs
COMPILE_MODE = "reduce-overhead"


def framework(model: str, precision: str, steps: int, workdir: str,
              marks: list | None = None, compile_mode: str | None = None) -> tuple[float, float]:
    """``Run.fit()`` on ``device=gpu`` with the default plugins; returns (wall seconds per timed step times
    ``steps``, last logged loss)."""
    batch_size = MODELS[model][1]
    common = [f"device={DEVICE}", f"precision={precision}"]
    if compile_mode:
        common += ["backend.compile=true", f"backend.compile_mode={compile_mode}"]
    if model == "mlp2":
        os.environ["CSF_BENCH_MODEL"] = "mlp2"
        cfg = loop_overhead.framework_config("premade", steps, batch_size, extra=tuple(common))
    else:
        cfg = csf.compose(common + MODELS[model][0] + loop_overhead.PLAIN_TRAINING + [
            f"loop.max_steps={steps}", "loop.eval_every=null", f"loop.log_every={LOG_EVERY}",
            f"data.batch_size={batch_size}", "data.shuffle=true", f"seed={SEED}"])
        cfg.data.val = None
    skip = COMPILE_SKIP if compile_mode and steps > 2 * COMPILE_SKIP else 0
    timer = WallTimer(skip)
    plugins = [timer] if marks is None else [timer, StepMarks(marks)]
    output_dir = tempfile.mkdtemp(dir=workdir)
    run = csf.Run(cfg, plugins=plugins, output_dir=output_dir)
    summary = run.fit()
    assert summary["status"] == "completed" and summary["global_step"] == steps, summary
    framework.compile = summary.get("compile")
    # what torch's compile loggers said (``torch_log`` events: a CUDA graph skipped, a recompilation's reason)
    with open(os.path.join(output_dir, "events.jsonl")) as events:
        framework.torch_logs = [json.loads(line).get("message", "") for line in events if '"torch_log"' in line]
    return timer.seconds * steps / (steps - skip), summary["metrics"]["train/loss"]


def contestant(args) -> dict:
    """One measurement in this fresh process: a short untimed warm-up run, then the timed one."""
    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    _, _, warmup, steps = MODELS[args.model]
    steps = args.steps or steps
    timed = hand_written if args.contestant == "hand" else None
    with (tempfile.TemporaryDirectory(prefix="csf-bench-") as workdir, contextlib.redirect_stderr(io.StringIO()),
          contextlib.redirect_stdout(io.StringIO())):
        def once(n):
            return timed(args.model, args.precision, n) if timed else framework(
                args.model, args.precision, n, workdir, compile_mode=args.compile)
        once(warmup)
        first = getattr(framework, "compile", None)  # the warm-up run's compile: from Inductor's on-disk cache
        seconds, loss = once(steps)
    result = {"ms_per_step": 1e3 * seconds / steps, "loss": loss}
    if args.compile:
        result.update(compile_first_s=first["seconds"], cache=first["cache"])
    return result


def command(*args: str) -> list[str]:
    return harness.python("benchmarks.gpu", *args)


def same_run(name: str, results: dict[str, list[dict]], rel: float) -> None:
    """The contestants trained the same run: their last logged losses agree to ``rel`` (the GPU's kernels
    may order a reduction differently from one process to the next, and bfloat16 rounds)."""
    losses = [r["loss"] for rs in results.values() for r in rs]
    if max(losses) - min(losses) > rel * abs(min(losses)):
        raise AssertionError(f"{name}: the contestants' last logged losses differ: "
                             f"{ {k: [r['loss'] for r in v] for k, v in results.items()} }")


def figures(rounds: int, steps: int = 0, only: str | None = None) -> list[harness.Figure]:
    """Per-step wall time on CUDA, csframework against the hand loop, and bfloat16 against float32 (``only``:
    one model's figures; ``steps``: timed steps, 0 for each model's default)."""
    if cuda() and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs CUDA (or CSF_BENCH_DEVICE=cpu to check it on the CPU)")
    out = []
    n = ("--steps", str(steps))
    where = f"CUDA ({torch.cuda.get_device_name()})" if cuda() else "CPU (CSF_BENCH_DEVICE=cpu)"
    for model, label, precisions in [
            ("transformer", "embedded default transformer", ["float32", "bfloat16"]),
            ("mlp2", "784-256-256-10 MLP", ["float32"]),
            ("transformer-large", "default transformer, 8 layers, d_model 1024, 512-byte windows",
             ["float32", "bfloat16"])]:
        if only not in (None, model):
            continue
        contestants = {}
        compiled = model != "mlp2"  # the compiled rows: the launch-bound model (CUDA graphs) and the busy one
        for p in precisions:
            args = ("--model", model, "--precision", p, *n)
            if model != "transformer-large":  # large: the bf16 speed-up only (its step is the GPU's work)
                contestants[f"hand {p}"] = command("--contestant", "hand", *args)
            contestants[f"framework {p}"] = command("--contestant", "framework", *args)
            if compiled:
                contestants[f"compiled {p}"] = command("--contestant", "framework", "--compile", COMPILE_MODE, *args)
        res = harness.interleaved(contestants, rounds)
        cmd = f"python -m benchmarks.gpu --only {model}"
        for p in precisions:
            eager = {k: v for k, v in res.items() if k.endswith(p) and not k.startswith("compiled")}
            same_run(f"{model} {p}", eager, 1e-3 if p == "float32" else 2e-2)
            if f"compiled {p}" in res:  # Inductor's kernels round differently, over hundreds of AdamW steps
                same_run(f"{model} {p} compiled", {**eager, "compiled": res[f"compiled {p}"]}, 2e-2)
            if f"hand {p}" in res:
                out.append(harness.Figure(
                    name=f"per-step wall time on {where}: {label}, {p}", unit="ms/step",
                    samples=[r["ms_per_step"] for r in res[f"framework {p}"]], baseline="hand loop, pre-made batches",
                    baseline_samples=[r["ms_per_step"] for r in res[f"hand {p}"]], target="<= 1.05x", limit=1.05,
                    command=cmd))
            if f"compiled {p}" in res:
                samples = [r["ms_per_step"] for r in res[f"compiled {p}"]]
                hand = f"hand {p}" in res  # (the large model's baseline is the framework's eager step)
                out.append(harness.Figure(
                    name=f"per-step wall time on {where}, backend.compile=true compile_mode={COMPILE_MODE}: {label}, "
                         f"{p}", unit="ms/step", samples=samples,
                    baseline="hand loop, pre-made batches (eager)" if hand else "csframework eager",
                    baseline_samples=[r["ms_per_step"] for r in res[f"hand {p}" if hand else f"framework {p}"]],
                    target="<= 0.4x" if p == "float32" and hand else "", limit=0.4 if p == "float32" and hand else None,
                    command=cmd))
                out.append(harness.Figure(
                    name=f"compile time on {where} (Inductor's on-disk cache from an earlier process): {label}, {p}",
                    unit="s", samples=[r["compile_first_s"] for r in res[f"compiled {p}"]], kind="value",
                    command=cmd))
        if compiled and len(precisions) == 2:
            out.append(harness.Figure(
                name=f"bfloat16 step time over float32 on {where}, both compiled ({COMPILE_MODE}): {label}",
                unit="ms/step", samples=[r["ms_per_step"] for r in res["compiled bfloat16"]],
                baseline="float32 compiled", baseline_samples=[r["ms_per_step"] for r in res["compiled float32"]],
                target="<= 1.0x (bf16 at least as fast)", limit=1.0, command=cmd))
        if "bfloat16" in precisions:
            out.append(harness.Figure(
                name=f"bfloat16 step time over float32 on {where}: {label} (csframework both)", unit="ms/step",
                samples=[r["ms_per_step"] for r in res["framework bfloat16"]], baseline="float32",
                baseline_samples=[r["ms_per_step"] for r in res["framework float32"]],
                target="<= 0.556x (bf16 >= 1.8x as fast)", limit=1 / 1.8,
                command=f"python -m benchmarks.gpu --only {model}"))
    return out


def profile(model: str, precision: str, steps: int, compile_mode: str | None = None) -> str:
    """Where a step's time goes, hand loop against framework in this one process (``compile_mode``: the
    framework compiled instead of the hand loop's side): the host clock between step ends (first steps, median,
    total) and, over 30 more steps, the device's own busy time per step (the kernels' summed time: a step that
    takes longer waits on the host) and torch.profiler's busiest operations."""
    import statistics

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    steps = steps or MODELS[model][3]
    report, profiled = [], 30
    with tempfile.TemporaryDirectory(prefix="csf-bench-") as workdir:
        sides = {"hand": lambda n, m: hand_written(model, precision, n, m),
                 "framework": lambda n, m: framework(model, precision, n, workdir, m)}
        if compile_mode:
            sides = {f"framework compiled ({compile_mode})":
                     lambda n, m: framework(model, precision, n, workdir, m, compile_mode=compile_mode)}
        for name, side in sides.items():
            with contextlib.redirect_stderr(io.StringIO()):
                side(MODELS[model][2], None)
                marks: list[float] = []
                seconds, _ = side(steps, marks)
                gaps = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
                with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    side(profiled, None)
            averages = prof.key_averages()
            device = [e for e in averages if e.device_type == DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in device) / 1e3 / profiled
            kernels = sum(e.count for e in device) / profiled
            report.append(f"== {name}, {precision}: {1e3 * seconds / steps:.3f} ms/step wall; host gaps between step "
                          f"ends: median {statistics.median(gaps):.3f} ms, mean {statistics.mean(gaps):.3f}, first "
                          f"{[round(g, 3) for g in gaps[:5]]}, slowest {sorted(round(g, 2) for g in gaps)[-8:]}; "
                          f"device busy {busy:.3f} ms/step in {kernels:.0f} kernels/step (the profiled "
                          f"{profiled}-step run, first steps included); compile: {getattr(framework, 'compile', None)}; "
                          f"torch's compile log: {[m[:300] for m in getattr(framework, 'torch_logs', [])][:12]}")
            report.append(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
            report.append(averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    return "\n".join(report)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contestant", choices=["hand", "framework"])
    parser.add_argument("--model", choices=list(MODELS), default="transformer")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (0: the model's default)")
    parser.add_argument("--only", choices=list(MODELS), help="one model's figures")
    parser.add_argument("--profile", action="store_true",
                        help="where a step's time goes (one process; with --compile: the compiled framework's)")
    parser.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                        help="the framework contestant with backend.compile=true and this compile_mode")
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args)))
    elif args.profile:
        print(profile(args.model, args.precision, args.steps, args.compile))
    else:
        print(harness.table(figures(args.rounds, args.steps, args.only)))


if __name__ == "__main__":
    main()

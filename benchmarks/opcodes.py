"""Python bytecode instructions per training step: ``Run.fit()`` with the default plugins against the
hand-written loop over pre-made batches, on the tiny MLP (``benchmarks.loop_overhead``'s own contestants).

The loop's own time is CPython running the framework's Python, so the bytecode instructions it executes are a
close, load-independent measure of it, and far quicker to take than ``benchmarks.instructions``' callgrind
counts (about a minute on 2 cores, where callgrind takes ten when they are idle and hours when they are not).
It leaves out what C code costs (a ``detach``, a ``loss.item()``): read it beside the timed ``--only
own-time``. Counted in one process with ``sys.settrace`` (``f_trace_opcodes``): each side trains twice, for
``STEPS[0]`` and ``STEPS[1]`` steps after a warm-up, and a step's count is the difference over the
difference of the steps, so set-up and tear-down cancel; the framework's are counted from ``on_train_start``
to ``on_train_end`` (its run's set-up is Hydra's and does not repeat exactly). C functions called from
Python are counted too (``sys.setprofile``'s ``c_call`` events).

    python -m benchmarks.opcodes                 # the counts
    python -m benchmarks.opcodes --functions 30  # and the functions whose counts differ most
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import io
import os
import sys
import tempfile

from benchmarks import loop_overhead

#: Timed steps of the two runs of each side: two and four of the tiny MLP's epochs of 256 batches.
STEPS = (512, 1024)


class Counter:
    """Bytecode instructions by code object and C calls by name, while ``on``."""

    def __init__(self):
        self.opcodes: collections.Counter = collections.Counter()
        self.c_calls: collections.Counter = collections.Counter()

    def _opcode(self, frame, event, arg):
        if event == "opcode":
            self.opcodes[frame.f_code] += 1
        return self._opcode

    def _frame(self, frame, event, arg):
        frame.f_trace_opcodes = True
        return self._opcode

    def _profile(self, frame, event, arg):
        if event == "c_call":
            self.c_calls[getattr(arg, "__qualname__", repr(arg))] += 1

    def on(self) -> None:
        sys.settrace(self._frame)
        sys.setprofile(self._profile)

    @staticmethod
    def off() -> None:
        sys.settrace(None)
        sys.setprofile(None)


def counted_timer(counter: Counter) -> loop_overhead.StepTimer:
    """``loop_overhead``'s step timer, counting from the start of training to its end."""

    class Counted(loop_overhead.StepTimer):
        @loop_overhead.csf.hookimpl(tryfirst=True)
        def on_train_start(self):
            counter.on()

        @loop_overhead.csf.hookimpl(tryfirst=True)
        def on_train_end(self):
            counter.off()

    return Counted()


def count(side: str, steps: int, workdir: str) -> Counter:
    """The counts of one run of ``side`` (``hand`` or ``framework``) of ``steps`` steps."""
    counter = Counter()
    _, batch_size, _ = loop_overhead.MODELS["tiny"]
    if side == "hand":
        made = loop_overhead.premade_batches

        def uncounted(*args):  # made before the hand loop's clock starts: not part of its steps
            counter.off()
            try:
                return made(*args)
            finally:
                counter.on()

        counter.on()
        try:
            with _replaced(loop_overhead, "premade_batches", uncounted):
                loop_overhead.hand_written("premade", steps, batch_size)
        finally:
            counter.off()
        return counter
    with tempfile.TemporaryDirectory(dir=workdir) as out:
        run = loop_overhead.csf.Run(loop_overhead.framework_config("premade", steps, batch_size),
                                    plugins=[counted_timer(counter)], output_dir=out)
        assert run.fit()["global_step"] == steps
    return counter


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def measure(steps: tuple[int, int] = STEPS) -> dict[str, tuple[Counter, Counter]]:
    """Each side's two counted runs, after a warm-up of each (one thread, no installed plugin)."""
    os.environ["CSF_BENCH_MODEL"] = "tiny"
    os.environ["CSFRAMEWORK_PLUGINS_AUTOLOAD"] = "0"
    loop_overhead.torch.set_num_threads(1)
    _, batch_size, _ = loop_overhead.MODELS["tiny"]
    with tempfile.TemporaryDirectory(prefix="csf-opcodes-") as workdir, contextlib.redirect_stderr(io.StringIO()):
        loop_overhead.hand_written("premade", loop_overhead.WARMUP_STEPS, batch_size)
        count("framework", loop_overhead.WARMUP_STEPS, workdir)
        gc.collect()
        return {side: (count(side, steps[0], workdir), count(side, steps[1], workdir)) for side in ("hand", "framework")}


def per_step(runs: tuple[Counter, Counter], what: str, steps: tuple[int, int] = STEPS) -> dict[str, float]:
    """Per function (``file:line:name``) or C function, its count a step: ``what`` is ``opcodes`` or ``c_calls``."""
    short, long = (_by_name(getattr(run, what)) for run in runs)
    return {name: (long[name] - short[name]) / (steps[1] - steps[0]) for name in set(short) | set(long)}


def _by_name(counts: collections.Counter) -> collections.Counter:
    named: collections.Counter = collections.Counter()
    for key, n in counts.items():
        named[f"{os.path.basename(key.co_filename)}:{key.co_firstlineno}:{key.co_name}"
              if hasattr(key, "co_filename") else key] += n
    return named


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=0, metavar="N",
                        help="also the N functions whose per-step counts differ most between the sides")
    args = parser.parse_args(argv)
    results = measure()
    for what in ("opcodes", "c_calls"):
        sides = {side: per_step(runs, what) for side, runs in results.items()}
        totals = {side: sum(counts.values()) for side, counts in sides.items()}
        print(f"{what} per step: csframework {totals['framework']:,.1f}, hand-written loop {totals['hand']:,.1f}"
              f" ({totals['framework'] - totals['hand']:+,.1f})")
        if args.functions:
            names = set(sides["hand"]) | set(sides["framework"])
            difference = {n: sides["framework"].get(n, 0.0) - sides["hand"].get(n, 0.0) for n in names}
            for name in sorted(names, key=lambda n: -abs(difference[n]))[:args.functions]:
                print(f"{difference[name]:+10.1f}  {name}")


if __name__ == "__main__":
    main()

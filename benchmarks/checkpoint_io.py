"""Checkpoint save and load time against plain ``torch.save`` / ``torch.load`` of the same state.

Two contestants, each a fresh process per round, on the same state: a model of ``--params`` parameters
(default 100M: 20 linear layers, float32, 400 MB) plus a loop position, as ``Run.state_dict()`` holds them.
Each saves and loads it ``--repeats`` times after one untimed warm-up (caches, allocators) and reports the
best time of each:

* ``csframework``: the checkpoint plugin's ``write_checkpoint`` (state.pt streamed through a CRC-32,
  config.yaml, meta.json, every file fsynced, the directory renamed into place) and ``read_checkpoint``
  (sizes and checksums verified while ``torch.load(weights_only=True)`` reads the file);
* ``torch``: ``torch.save(state, path)`` and ``torch.load(path, weights_only=True)``; it also times
  ``torch.save`` followed by an fsync, the durable equivalent (printed beside the figures).

Files go to ``--dir`` (default: a temporary directory). Before each timed operation the previous file is
removed and ``os.sync()`` flushes every dirty page, so no operation pays for another's write-back; loads
read from a warm page cache (the CPU cost of the format, not of the disk) into fresh memory, as a resumed
run's new process does (glibc's mmap threshold is fixed for both contestants; see ``measure``).

    python -m benchmarks.checkpoint_io                      # 3 rounds, 100M parameters
    python -m benchmarks.checkpoint_io --params 10_000_000 --repeats 5
    python -m benchmarks.checkpoint_io --contestant torch   # one measurement, as JSON
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks import harness

MODULE = "benchmarks.checkpoint_io"  #: this module (``__name__`` is ``__main__`` under ``python -m``)
PARAMS = 100_000_000


def model_of(params: int) -> nn.Module:
    layers, width = 20, 2000
    out = max(1, round(params / layers / (width + 1)))
    return nn.Sequential(*[nn.Linear(width, out) if i % 2 == 0 else nn.Linear(out, width) for i in range(layers)])


def timed(fn, remove: Path | None = None) -> float:
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True) if remove.is_dir() else remove.unlink(missing_ok=True)
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def contestant(which: str, params: int, repeats: int, directory: str | None) -> dict:
    """Save and load the state ``repeats + 1`` times (the first untimed); the best seconds of each."""
    from csframework.builtin.checkpoint import read_checkpoint, write_checkpoint

    torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))
    torch.manual_seed(0)
    model = model_of(params)
    state = {"model": model.state_dict(), "loop": {"global_step": 1}}
    work = Path(tempfile.mkdtemp(prefix="csf-ckpt-io-", dir=directory))
    plain, root = work / "plain.pt", work / "checkpoints"

    def plain_fsync():
        with open(plain, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    if which == "torch":
        ops = {"save": (lambda: torch.save(state, plain), plain),
               "save_fsync": (plain_fsync, plain),
               "load": (lambda: torch.load(plain, map_location="cpu", weights_only=True), None)}
    else:
        ops = {"save": (lambda: write_checkpoint(root, "step-1", state, {"global_step": 1}, "seed: 0\n"),
                        root / "step-1"),
               "load": (lambda: read_checkpoint(root / "step-1"), None)}
    times: dict[str, list[float]] = {name: [] for name in ops}
    try:
        for i in range(repeats + 1):
            for name, (fn, remove) in ops.items():
                seconds = timed(fn, remove)
                if i:
                    times[name].append(seconds)
        loaded = torch.load(plain, weights_only=True) if which == "torch" else read_checkpoint(root / "step-1")[0]
        if not all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items()):
            raise RuntimeError(f"{which}: the state read back differs from the state saved")
        size = (plain if which == "torch" else root / "step-1" / "state.pt").stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    return {f"{name}_s": min(t) for name, t in times.items()} | {"params": n, "bytes": size}


def measure(rounds: int, params: int = PARAMS, repeats: int = 3, directory: str | None = None) -> dict:
    extra = ["--params", str(params), "--repeats", str(repeats)] + (["--dir", directory] if directory else [])
    contestants = {name: harness.python(MODULE, "--contestant", name, *extra) for name in ("torch", "csframework")}
    # A load's time is mostly page faults on the fresh memory of its 400 MB of tensors (about 100k), as in
    # a resumed run's new process. With glibc's adaptive thresholds a process may instead keep the memory of
    # a load it freed and reuse it for the next: 0.04 s instead of 0.19, on one side and not the other,
    # depending on each process's allocation history. A fixed threshold maps every tensor fresh on both.
    env = harness.contestant_env() | {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return harness.interleaved(contestants, rounds, env)


def figures(rounds: int, params: int = PARAMS, repeats: int = 3, results: dict | None = None) -> list[harness.Figure]:
    """csframework's checkpoint save and load time over ``torch.save`` and ``torch.load`` of the same state."""
    results = results or measure(rounds, params, repeats)
    size = f"{params / 1e6:g}M parameters"
    command = f"python -m {MODULE} --rounds {rounds}" + (f" --params {params}" if params != PARAMS else "")
    return [harness.Figure(name=f"checkpoint {op} ({size})", unit="s",
                           samples=[r[f"{op}_s"] for r in results["csframework"]],
                           baseline=f"torch.{op}", baseline_samples=[r[f"{op}_s"] for r in results["torch"]],
                           target="<= 1.5x", limit=1.5, command=command)
            for op in ("save", "load")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--params", type=lambda s: int(float(s.replace("_", ""))), default=PARAMS)
    parser.add_argument("--repeats", type=int, default=3, help="timed saves and loads per process (best)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--contestant", choices=["torch", "csframework"], help="one measurement, as JSON")
    args = parser.parse_args(argv)
    if args.contestant:
        print(json.dumps(contestant(args.contestant, args.params, args.repeats, args.dir)))
        return
    results = measure(args.rounds, args.params, args.repeats, args.dir)
    print(harness.table(figures(args.rounds, args.params, args.repeats, results)))
    ours, theirs = results["csframework"], results["torch"]
    durable = statistics.median(c["save_s"] / t["save_fsync_s"] for c, t in zip(ours, theirs))
    print(f"\n{ours[0]['params'] / 1e6:.1f}M parameters, state.pt {ours[0]['bytes'] / 1e6:.0f} MB, best of "
          f"{args.repeats} per process; torch.save + fsync "
          f"{statistics.median(t['save_fsync_s'] for t in theirs):.3f} s (csframework save / it: {durable:.2f}x)")


if __name__ == "__main__":
    main()

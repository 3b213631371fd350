"""Checkpoint save and load time against plain ``torch.save`` / ``torch.load``.

A model of ``--params`` parameters (default 100M: 20 linear layers, float32, 400 MB) is saved and loaded
``--repeats`` times each way, alternating, and the best time of each is reported:

* csframework: ``write_checkpoint`` (state.pt streamed through a CRC-32, config.yaml, meta.json, every file
  fsynced, the directory renamed into place) and ``read_checkpoint`` (sizes and checksums verified while
  ``torch.load(weights_only=True)`` reads the file);
* plain: ``torch.save(state, path)`` and ``torch.load(path, weights_only=True)``; also ``torch.save`` followed
  by an fsync, the durable equivalent.

Files go to ``--dir`` (default: a temporary directory). Before each timed operation the previous file is
removed and ``os.sync()`` flushes every dirty page, so no side pays for the other's write-back; loads read
from a warm page cache (the CPU cost of the format, not of the disk).

    python benchmarks/checkpoint_io.py
    python benchmarks/checkpoint_io.py --params 10_000_000 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from csframework.builtin.checkpoint import read_checkpoint, write_checkpoint


def model_of(params: int) -> nn.Module:
    layers, width = 20, 2000
    out = max(1, round(params / layers / (width + 1)))
    return nn.Sequential(*[nn.Linear(width, out) if i % 2 == 0 else nn.Linear(out, width) for i in range(layers)])


def timed(fn, remove=None) -> float:
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True) if remove.is_dir() else remove.unlink(missing_ok=True)
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=lambda s: int(float(s.replace("_", ""))), default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = model_of(args.params)
    n = sum(p.numel() for p in model.parameters())
    state = {"model": model.state_dict(), "loop": {"global_step": 1}}
    meta = {"global_step": 1}
    work = Path(args.dir or tempfile.mkdtemp(prefix="csf-ckpt-io-"))
    work.mkdir(parents=True, exist_ok=True)
    plain = work / "plain.pt"
    root = work / "checkpoints"

    def plain_fsync():
        with open(plain, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    times: dict[str, list[float]] = {k: [] for k in ("csf save", "torch.save", "torch.save+fsync",
                                                      "csf load", "torch.load")}
    try:
        for i in range(args.repeats + 1):  # the first round warms caches and allocators, and is dropped
            t = {
                "torch.save": timed(lambda: torch.save(state, plain), plain),
                "csf save": timed(lambda: write_checkpoint(root, "step-1", state, meta, "seed: 0\n"),
                                  root / "step-1"),
                "torch.save+fsync": timed(plain_fsync, plain),
                "torch.load": timed(lambda: torch.load(plain, map_location="cpu", weights_only=True)),
                "csf load": timed(lambda: read_checkpoint(root / "step-1")),
            }
            if i:
                for k, v in t.items():
                    times[k].append(v)
        loaded, _ = read_checkpoint(root / "step-1")
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
        size = (root / "step-1" / "state.pt").stat().st_size
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    best = {k: min(v) for k, v in times.items()}
    print(f"checkpoint I/O: {n / 1e6:.1f}M parameters, state.pt {size / 1e6:.0f} MB, best of {args.repeats}; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"  save: csframework {best['csf save']:.3f} s, torch.save {best['torch.save']:.3f} s "
          f"-> {best['csf save'] / best['torch.save']:.2f}x "
          f"(torch.save + fsync {best['torch.save+fsync']:.3f} s -> "
          f"{best['csf save'] / best['torch.save+fsync']:.2f}x)")
    print(f"  load: csframework {best['csf load']:.3f} s, torch.load {best['torch.load']:.3f} s "
          f"-> {best['csf load'] / best['torch.load']:.2f}x")


if __name__ == "__main__":
    main()

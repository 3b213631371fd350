"""``python -m benchmarks``: every figure of docs/design/figures.md's tables, measured now on this machine.

Each figure comes from one module of this package (run one alone with ``python -m benchmarks.<module>``);
each is measured by interleaved rounds of fresh processes (``benchmarks.harness``). ``--write`` writes the
tables into docs/design/figures.md between their markers (``benchmarks``; ``benchmarks-gpu`` for the GPU figures, measured
only where CUDA is); ``--json`` saves every figure with its samples.

    python -m benchmarks                          # all figures, 5 rounds (about 15 minutes on 2 cores)
    python -m benchmarks --only gpu --write       # the GPU figures alone, on a machine with CUDA
    python -m benchmarks --only loop_overhead startup --rounds 3
    python -m benchmarks --write                  # and rewrite the tables of docs/design/figures.md
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import re
import sys
import time

from . import harness

#: The modules measured, in the table's order.
MODULES = ["loop_overhead", "data_fetch", "startup", "evaluation", "csx_emulator", "memory_growth", "checkpoint_io"]
#: Measured only where CUDA is, into the GPU table.
GPU_MODULES = ["gpu"]


def header(info: dict, rounds: int, seconds: float, gpu: bool) -> str:
    command = "python -m benchmarks" + (" --only gpu" if gpu else "")
    where = (f"{info['gpu']} (CUDA {info['cuda']}) with {info['cpu']} ({info['cores']} cores)" if gpu
             else f"{info['cpu']} ({info['cores']} cores)")
    return (f"Measured {datetime.date.today().isoformat()} with `{command} --rounds {rounds}` on {where}, "
            f"{info['os']}, Python {info['python']}, torch {info['torch']}, "
            f"{'with ' + ', '.join(info['beside_core']) if info['beside_core'] else 'no Hydra plugin or rich'} "
            f"installed, 1 torch thread per process; {rounds} "
            f"interleaved rounds of fresh processes per figure ({seconds / 60:.0f} min in all). Each cell: median "
            "[min-max]; the ratio is the median of the per-round ratios [their min-max].")


#: The page that holds the tables, relative to the project root.
TABLES_PAGE = "docs/design/figures.md"


def write_table(section: str, text: str) -> None:
    """Replace the tables page's ``<!-- section:start -->`` ... ``<!-- section:end -->`` with ``text``."""
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    path = harness.ROOT / TABLES_PAGE
    page = path.read_text(encoding="utf-8")
    if start not in page or end not in page:
        raise SystemExit(f"{TABLES_PAGE} has no {start} ... {end} section to write the table into")
    new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{text}\n{end}", page, flags=re.S)
    path.write_text(new, encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved fresh-process rounds per figure")
    parser.add_argument("--only", nargs="+", choices=MODULES + GPU_MODULES, help="these modules only")
    parser.add_argument("--write", action="store_true", help=f"write the tables into {TABLES_PAGE}")
    parser.add_argument("--json", help="save the figures and their samples to this file")
    args = parser.parse_args(argv)
    import torch

    names = args.only or MODULES + (GPU_MODULES if torch.cuda.is_available() else [])
    info, figures, tables = harness.machine(), [], {}
    for section, modules in [("benchmarks", MODULES), ("benchmarks-gpu", GPU_MODULES)]:
        start, measured = time.perf_counter(), []
        for name in (n for n in names if n in modules):
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            measured += importlib.import_module(f"benchmarks.{name}").figures(args.rounds)
        if measured:
            seconds = time.perf_counter() - start
            tables[section] = (header(info, args.rounds, seconds, gpu=section != "benchmarks") + "\n\n"
                               + harness.table(measured))
            figures += measured
    print("\n\n".join(tables.values()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "rounds": args.rounds, "figures": [x.row() for x in figures]}, f, indent=1)
    if args.write:
        for section, text in tables.items():
            write_table(section, text)
    return 0 if all(f.met is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())

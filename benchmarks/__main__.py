"""``python -m benchmarks``: every figure of the README's performance table, measured now on this machine.

Each figure comes from one module of this package (run one alone with ``python -m benchmarks.<module>``);
each is measured by interleaved rounds of fresh processes (``benchmarks.harness``). ``--readme`` writes the
table into README.md between its ``benchmarks`` markers; ``--json`` saves every figure with its samples.

    python -m benchmarks                          # all figures, 5 rounds (about 15 minutes on 2 cores)
    python -m benchmarks --only loop_overhead startup --rounds 3
    python -m benchmarks --readme                 # and rewrite the README's table
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
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


def header(info: dict, rounds: int, seconds: float) -> str:
    return (f"Measured {datetime.date.today().isoformat()} with `python -m benchmarks --rounds {rounds}` on "
            f"{info['cpu']} ({info['cores']} cores), {info['os']}, Python {info['python']}, torch {info['torch']}, "
            f"1 torch thread per process; {rounds} interleaved rounds of fresh processes per figure "
            f"({seconds / 60:.0f} min in all). Each cell: median [min-max]; the ratio is the median of the "
            "per-round ratios.")


def write_readme(text: str) -> None:
    path = harness.ROOT / "README.md"
    readme = path.read_text(encoding="utf-8")
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} section to write the table into")
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{text}\n{END}", readme, flags=re.S)
    path.write_text(new, encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved fresh-process rounds per figure")
    parser.add_argument("--only", nargs="+", choices=MODULES, help="these modules only")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    parser.add_argument("--json", help="save the figures and their samples to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures: list[harness.Figure] = []
    for name in args.only or MODULES:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        figures += importlib.import_module(f"benchmarks.{name}").figures(args.rounds)
    info = harness.machine()
    text = header(info, args.rounds, time.perf_counter() - start) + "\n\n" + harness.table(figures)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "rounds": args.rounds, "figures": [x.row() for x in figures]}, f, indent=1)
    if args.readme:
        write_readme(text)
    return 0 if all(f.met is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())

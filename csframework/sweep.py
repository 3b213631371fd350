"""A Hydra callback that writes one table of a multirun sweep: every job's config choices and final
metrics, as ``sweep.csv`` in the sweep directory (registered in ``conf/config.yaml``)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback


def sweep_rows(sweep_dir: Path) -> list[dict]:
    """One row per job directory (those with ``.hydra/overrides.yaml``), in job order."""
    rows = []
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").exists()]
    for job in sorted(jobs, key=lambda p: (len(p.name), p.name)):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
        row = {"job": job.name}
        row.update(o.split("=", 1) for o in overrides if "=" in o)
        summary_path = job / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            row["status"] = summary.get("status")
            row["global_step"] = summary.get("global_step")
            row.update(summary.get("metrics", {}))
        else:
            row["status"] = "no summary"
        rows.append(row)
    return rows


def write_sweep_table(sweep_dir: Path) -> Path | None:
    rows = sweep_rows(sweep_dir)
    if not rows:
        return None
    columns = list(dict.fromkeys(key for row in rows for key in row))
    path = sweep_dir / "sweep.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


class SweepTable(Callback):
    """Writes ``sweep.csv`` when a multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            write_sweep_table(sweep_dir)

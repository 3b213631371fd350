"""Sweep directories for the in-process sweep tests (tests/unit/test_sweep*.py): the ``area`` fixture (a
sweep directory under attack beside a victim tree, ``hostile.Hostile``) and job directories with a given
``summary.json``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostile import Hostile


@pytest.fixture
def area(tmp_path):
    """A scratch area: ``sweep`` (under attack) beside a victim tree that must stay as it is."""
    h = Hostile(tmp_path)
    h.sweep = tmp_path / "sweep"
    h.sweep.mkdir()
    return h


def fake_job(sweep: Path, num: int, summary: bytes | None, overrides=("optimizer.lr=0.1",)) -> Path:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (d / "summary.json").write_bytes(summary)
    return d


GOOD = json.dumps({"status": "completed", "global_step": 8, "metrics": {"val/loss": 0.5, "odd": "NaN"}}).encode()

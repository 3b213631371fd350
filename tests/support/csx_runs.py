"""Runs of the tiny Blobs config on a device, and parameter comparisons: shared by the CSX tests
(tests/unit/test_csx_backend.py, test_csx_inductor.py)."""
from __future__ import annotations

from pathlib import Path

import csframework as csf
import fixtures


def run_on(device: str, tmp_path: Path, *overrides: str, name: str | None = None, plugins=()):
    """Build and fit the tiny Blobs run on ``device``; returns (run, summary)."""
    extra = [f"device={device}"]
    if device == "csx":
        extra.append(f"backend.compile_dir={tmp_path / 'compile'}")
    cfg = fixtures.compose(*extra, *overrides)
    run = csf.Run(cfg, plugins=list(plugins), output_dir=tmp_path / (name or device))
    return run, run.fit()


def params_of(run) -> dict:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)

"""``torchrun`` launches of ``python -m csframework`` and parameter comparisons across them: shared by
tests/e2e/test_distributed.py and test_fsdp.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def torchrun(launcher: list[str], args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([TORCHRUN, *launcher, "-m", "csframework", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    return done


def assert_same_params(a: dict, b: dict, exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)

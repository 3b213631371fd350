"""Hostile run directories for the examples' scripts (issue 47 item 7): ``examples/char_gpt/sample.py`` and
``score.py`` read a run's checkpoint and then the text file its config names. A forged ``config.yaml`` whose
``data.train.path`` names a FIFO (before: the script blocked until killed) or ``/dev/zero`` (before: read until
memory ran out) fails at once with one line naming the key and the file."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from csframework.builtin.checkpoint import write_checkpoint
from gallery import EXAMPLES


def forged_run(tmp_path, text_path: str):
    """A run directory whose one checkpoint is sound (sizes, checksums, plain tensors) and whose config names
    ``text_path`` as the training text."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    config = (f"data:\n  train:\n    path: {text_path}\n    num_chars: null\n    block_size: 8\n"
              "model:\n  _target_: gpt.CharGPT\n  block_size: 8\n  layers: 1\n  heads: 1\n  width: 8\n")
    write_checkpoint(run / "checkpoints", "step-00000001", {"model": {"w": torch.zeros(2)}, "loop": {"global_step": 1}},
                     {"global_step": 1},
                     config)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("script, target", [("sample.py", "fifo"), ("score.py", "/dev/zero")])
def test_a_forged_text_path_is_one_error_line_not_a_hang(tmp_path, cli_env, script, target):
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    run = forged_run(tmp_path, target)
    result = subprocess.run([sys.executable, script, str(run)], cwd=EXAMPLES / "char_gpt", env=cli_env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (f"{script}: error: {run}: the checkpoint's data.train.path: {target}: it is not a "
                             "regular file (a FIFO, a device or a directory); give a text file\n")

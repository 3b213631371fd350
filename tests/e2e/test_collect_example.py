"""examples/classify computes whole-set accuracy and a confusion matrix from collected outputs, with the
command its README shows (issue 13 item 1)."""
import json

import pytest
import torch

from example import README, shell

pytestmark = pytest.mark.slow

def test_the_example_computes_whole_set_accuracy_and_a_confusion_matrix(tmp_path):
    command = next(line for line in README.splitlines() if "whole_set:WholeSet" in line)
    shell(command, extra=f" loop.max_steps=200 hydra.run.dir={tmp_path}")
    report = json.loads((tmp_path / "confusion.json").read_text())
    confusion = torch.tensor(report["confusion"])
    assert report["samples"] == 1024 and confusion.shape == (3, 3) and int(confusion.sum()) == 1024
    assert report["accuracy"] == pytest.approx(float(confusion.diagonal().sum()) / 1024)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["val/whole_set_accuracy"] == pytest.approx(report["accuracy"])

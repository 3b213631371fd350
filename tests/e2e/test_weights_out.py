"""Weights out of a run (issue 29 item 8): a run trained with the CLI, read back with ``csf.load_checkpoint``
into a model the user builds, holds the run's final parameters; the inference recipe of docs/guides/checkpoints.md ("Using the
trained weights") runs exactly as written. In-process cases: tests/unit/test_weights.py; sharded
checkpoints: tests/e2e/test_fsdp.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import csframework as csf
from csframework.models import Supervised

import fixtures
from example import example_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def test_a_cli_runs_final_weights_load_into_a_fresh_model(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "csframework", "--config-dir", fixtures.CONF, *fixtures.TINY,
                           "checkpoint.every_steps=3", "plugins.enable=[fixtures:FinalParams]",
                           f"hydra.run.dir={run_dir}"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    final = torch.load(run_dir / "final_params.pt", weights_only=True)  # what the run ended with

    ckpt = csf.load_checkpoint(run_dir)
    model = Supervised(net=fixtures.mlp(dim=8, hidden=16, classes=4))  # the user's model, fresh
    model.load_state_dict(ckpt.model)
    got = model.state_dict()
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    assert ckpt.step == 8 and ckpt.path == run_dir / "checkpoints" / "step-00000008"
    assert ckpt.config["loop"]["max_steps"] == 8


#: The page that shows the inference recipe.
GUIDE = ROOT / "docs/guides/checkpoints.md"


def section_blocks(title: str) -> list[str]:
    """The fenced blocks of the checkpoints guide's section ``title``, in order."""
    page = GUIDE.read_text()
    start = page.index(f"\n## {title}\n")
    end = page.find("\n## ", start + 1)
    return _BLOCK.findall(page[start:end if end != -1 else None])


def test_the_documented_inference_recipe_runs_as_written(tmp_path):
    """The two blocks run as a user runs them: the shell block from the checkout's root (a copy of
    ``examples/classify`` here), the Python block from the example's directory."""
    train, predict, rebuilt = section_blocks("Using the trained weights")
    assert train.startswith("cd examples/classify\npython -m csframework ") and "load_checkpoint" in predict
    example = tmp_path / "examples" / "classify"
    shutil.copytree(ROOT / "examples" / "classify", example, ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    env = dict(example_env(), PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))

    trained = subprocess.run(["bash", "-euc", train], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert trained.returncode == 0, trained.stderr[-4000:]
    predicted = subprocess.run([sys.executable, "-c", predict], cwd=example, env=env, capture_output=True, text=True,
                               timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-4000:]

    summary = json.loads((example / "outputs" / "spirals-best" / "summary.json").read_text())
    best = summary["best_checkpoint"]
    name, loss, arms, truth = re.fullmatch(r"(step-\d+), val/loss (\S+)\npredicted (\[.*\])\ntrue +(\[.*\])\n",
                                           predicted.stdout).groups()
    assert f"checkpoints/{name}" == best["path"] and float(loss) == pytest.approx(best["value"], abs=5e-4)
    right = sum(a == t for a, t in zip(json.loads(arms), json.loads(truth)))
    assert right >= 6, predicted.stdout  # the trained classifier (val/accuracy ~0.97), not fresh weights

    # csf.load_model's block, after the recipe's (which defines points): the same predictions
    again = subprocess.run([sys.executable, "-c", predict + rebuilt + "\nprint('rebuilt', arms.tolist())\n"],
                           cwd=example, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.splitlines()[-1] == f"rebuilt {arms}"

    # mode=predict's block, from the example's directory: one row per sample, the best checkpoint's
    command, line = section_blocks("Predictions for a dataset")
    written = subprocess.run(["bash", "-euc", command], cwd=example, env=env, capture_output=True, text=True,
                             timeout=600)
    assert written.returncode == 0, written.stderr[-4000:]
    rows = [json.loads(r) for r in (example / "outputs" / "spirals-predictions" / "predictions.jsonl").open()]
    assert [r["index"] for r in rows] == list(range(100)) and rows[0].keys() == json.loads(line).keys()
    sys.path.insert(0, str(example))
    try:
        from spirals import Spirals
    finally:
        sys.path.remove(str(example))
    truth_100 = Spirals(n=100, seed=7).y.tolist()
    assert sum(r["preds"] == t for r, t in zip(rows, truth_100)) >= 85  # val/accuracy ~0.97

"""Errors in the user's own code and names, on the command line (issue 29, items 1, 5 and 7): each is one
line, exit status 2, that names the key and the cause (a module that is not there, with "did you mean"; an
exception inside the user's module or constructor, with the user's file and line; a loss that is no
scalar, naming ``model.forward``), a disabled plugin's setting says the plugin is disabled, and a
``--config-name`` that is not there gets "did you mean".

The user's modules live in the directory the CLI runs from, as in a user's project."""
from __future__ import annotations

import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest

import fixtures
from forkrun import run_chains

ROOT = Path(__file__).resolve().parents[2]

MODULES = {
    "brokenmod.py": """\
        import torch
        import nonexistent_pkg


        class MLP(torch.nn.Module):
            pass
        """,
    "synmod.py": """\
        import torch


        class MLP(torch.nn.Module:
            pass
        """,
    "raisingmod.py": """\
        import torch


        class MLP(torch.nn.Module):
            def __init__(self, hidden: int = 0):
                super().__init__()
                if hidden <= 0:
                    raise ValueError(f"hidden must be positive, got {hidden}")


        class Data(torch.utils.data.Dataset):
            def __init__(self, n: int = 8):
                self.items = list(range(n))[n]
        """,
    "vecmod.py": """\
        import torch
        import torch.nn.functional as F


        class VectorLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 4)

            def forward(self, batch):
                inputs, targets = batch
                return F.cross_entropy(self.linear(inputs), targets, reduction="none")  # one loss per sample
        """,
}
#: the test configs (the Blobs data, an MLP) with a primary config of the user's own
TINY = ["model=blobs_mlp", "data=blobs", "loop.max_steps=2", "loop.eval_every=null", "loop.eval_steps=null"]
HINT = "run with debug=true for the traceback"
#: a vector loss: per sample, or the model's predictions (which .mean() would quietly train on)
NOT_A_SCALAR = ("not a scalar; a loss per sample: reduce it to one number (e.g. loss.mean()); the model's "
                "predictions: return the loss computed from them and the targets (e.g. F.mse_loss(preds, targets)), "
                "or a dict with it under 'loss'")

# (id, command-line arguments after --config-dir, the error line exactly)
CASES = [
    ("import-error", ["model._target_=brokenmod.MLP"],
     "csframework: error: model._target_: importing brokenmod.MLP failed: ModuleNotFoundError: No module named "
     f"'nonexistent_pkg' (brokenmod.py:2); {HINT}"),
    ("module-typo", ["model._target_=brokenmd.MLP"],
     "csframework: error: model._target_: brokenmd.MLP: no module named 'brokenmd' (did you mean 'brokenmod'?); "
     "check the dotted path, and that the module's directory is on the Python path (the directory you run "
     "from, or PYTHONPATH)"),
    ("name-typo", ["model.net._target_=fixtures.mlpp"],
     "csframework: error: model.net._target_: fixtures.mlpp: module 'fixtures' has no 'mlpp' (did you mean "
     "'mlp'?); check the dotted path"),
    ("raises-in-init", ["model._target_=raisingmod.MLP", "~model.net", "~model.loss"],
     "csframework: error: model: raisingmod.MLP(...) raised ValueError: hidden must be positive, got 0 "
     f"(raisingmod.py:8); {HINT}"),
    ("argument-typo", ["model=typo"],
     "csframework: error: model.hiden: raisingmod.MLP takes no argument 'hiden' (did you mean 'hidden'?), set in "
     "conf/model/typo.yaml; remove it or use one of its arguments (hidden)"),
    ("argument-typo-command-line", ["model=typo", "~model.hiden", "+model.hidn=3"],
     "csframework: error: model.hidn: raisingmod.MLP takes no argument 'hidn' (did you mean 'hidden'?), set on the "
     "command line (+model.hidn=3); remove it or use one of its arguments (hidden)"),
    ("dataset-raises", ["data.train._target_=raisingmod.Data", "~data.train.n"],
     "csframework: error: data.train: raisingmod.Data(...) raised IndexError: list index out of range "
     f"(raisingmod.py:13); {HINT}"),
    ("vector-loss", ["model._target_=vecmod.VectorLoss", "~model.net", "~model.loss"],
     "csframework: error: model.forward: vecmod.VectorLoss.forward(batch) returned a loss of shape [16], dtype "
     f"float32, {NOT_A_SCALAR}"),
    ("vector-loss-csx", ["model._target_=vecmod.VectorLoss", "~model.net", "~model.loss", "device=csx"],
     "csframework: error: model.forward: vecmod.VectorLoss.forward(batch) returned a loss of shape [16], dtype "
     f"float32, {NOT_A_SCALAR}"),
    ("config-name-typo", ["--config-name", "mien"],
     "csframework: error: --config-name: no primary config 'mien' in the config search path (available: config, "
     "mine); did you mean `--config-name mine`?"),
]
# the syntax error's message is Python's (it changes between versions): its place is the user's line
SYNTAX = ("syntax-error", ["model._target_=synmod.MLP"],
          r"csframework: error: model\._target_: importing synmod\.MLP failed: SyntaxError: .+ \(synmod\.py:4\); "
          + re.escape(HINT))
# without --config-dir: only csframework's own primary config
CONFIG_NAME = ("config-name-typo-builtin", ["--config-name", "confg"],
               "csframework: error: --config-name: no primary config 'confg' in the config search path (available: "
               "config); did you mean `--config-name config`?")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's project directory: their modules and their config directory (the test configs and a primary
    config ``mine``)."""
    root = tmp_path_factory.mktemp("project")
    for name, text in MODULES.items():
        (root / name).write_text(textwrap.dedent(text))
    shutil.copytree(fixtures.CONF, root / "conf")
    (root / "conf" / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    # a model argument misspelt in the user's config file (issue 50 item 7: the error names the file)
    (root / "conf" / "model" / "typo.yaml").write_text("_target_: raisingmod.MLP\nhiden: 16\n")
    return root


@pytest.fixture(scope="module")
def results(project):
    """Every case's command line, run from the project directory (which is on the Python path there, as
    for ``python -m csframework``)."""
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(project)))
    env.pop("HYDRA_FULL_ERROR", None)

    def argv(case: str, extra: list[str]) -> list[str]:
        options = extra if extra[0].startswith("--") else []
        conf = [] if case == CONFIG_NAME[0] else ["--config-dir", str(project / "conf")]
        return [*conf, *options, *TINY, *([] if options else extra), f"hydra.run.dir={project / 'runs' / case}"]

    cases = [*CASES, SYNTAX, CONFIG_NAME]
    found = run_chains([[{"argv": argv(case, extra)}] for case, extra, _ in cases], env, cwd=str(project))
    return {case: chain[0] for (case, _, _), chain in zip(cases, found)}


def error_lines(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if line.startswith("csframework: error:")]


@pytest.mark.slow
@pytest.mark.parametrize("case, _, line", [*CASES, CONFIG_NAME], ids=[c[0] for c in [*CASES, CONFIG_NAME]])
def test_an_error_in_the_user_s_code_or_names_is_one_line_naming_key_and_cause(results, case, _, line):
    result = results[case]
    assert result["returncode"] == 2, result["stderr"][-3000:]
    assert error_lines(result) == [line], result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"]


@pytest.mark.slow
def test_a_syntax_error_names_the_user_s_line(results):
    result = results[SYNTAX[0]]
    assert result["returncode"] == 2, result["stderr"][-3000:]
    assert len(error_lines(result)) == 1 and re.fullmatch(SYNTAX[2], error_lines(result)[0]), result["stderr"]
    assert "Traceback" not in result["stderr"]


@pytest.mark.slow
def test_debug_true_shows_the_user_s_traceback(project):
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(project)))
    argv = ["--config-dir", str(project / "conf"), *TINY, "model._target_=brokenmod.MLP", "debug=true",
            f"hydra.run.dir={project / 'runs' / 'debug'}"]
    result = run_chains([[{"argv": argv}]], env, cwd=str(project))[0][0]
    assert result["returncode"] != 0
    assert "Traceback" in result["stderr"] and 'brokenmod.py", line 2' in result["stderr"]
    assert "ModuleNotFoundError: No module named 'nonexistent_pkg'" in result["stderr"]


def test_the_docs_show_the_lines_a_user_sees():
    page = (ROOT / "docs/concepts/validation.md").read_text()
    shown = [line for line in page.splitlines() if line.startswith("csframework: error: model")]
    assert len(shown) == 3 and set(shown) <= {line for _, _, line in CASES}, shown
    forward = next(line for _, _, line in CASES if "model.forward" in line).removeprefix("csframework: error: ")
    assert forward in " ".join(page.split()), "the docs' model.forward line differs from what the CLI prints"

"""Errors the user's code raises while the run runs (issue 39 item 1): an exception in their ``forward``, dataset,
``collate_fn`` or plugin hook, at some step, is one line naming where in the run (the step), the user's
function and file:line and the exception, exit status 1 (a failed run), no traceback on the console; the
traceback is in the run directory's ``error.txt``. A forward output without ``loss`` is exit 2 naming the keys
it returned.

The user's modules live in the directory the CLI runs from, as in a user's project."""
from __future__ import annotations

import os
import re

import pytest

import fixtures
from doc_blocks import ROOT
from forkrun import run_chains

MODULES = {
    "usermod.py": """\
        import torch
        import torch.nn.functional as F


        class Net(torch.nn.Module):
            def __init__(self, dim: int = 9):
                super().__init__()
                self.linear = torch.nn.Linear(dim, 4)

            def forward(self, batch):
                inputs, targets = batch
                return F.cross_entropy(self.linear(inputs), targets)


        class Misspelt(Net):
            def forward(self, batch):
                inputs, targets = batch
                return {"los": F.cross_entropy(self.linear(inputs), targets), "logits": inputs}


        class EvalFails(Net):
            def forward(self, batch):
                if not self.training:
                    raise ZeroDivisionError("only in evaluation")
                return super().forward(batch)


        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                if i == 37:
                    raise KeyError(f"sample {i} is missing")
                return torch.zeros(8), torch.tensor(0)


        def collate(samples):
            raise ValueError("cannot collate")


        class Ragged(Data):
            def __getitem__(self, i):
                return torch.zeros(8 + i % 2), torch.tensor(0)
        """,
    "userplugin.py": """\
        from csframework import hookimpl


        @hookimpl
        def on_train_step_end(run, step, outputs):
            if step == 2:
                raise RuntimeError("the plugin broke")
        """,
}
TINY = ["model=blobs_mlp", "data=blobs", "loop.max_steps=3", "loop.eval_every=null", "data.shuffle=false"]
NET = ["~model.net", "~model.loss"]
SAVED = r"; the traceback is in runs/{case}/error\.txt \(debug=true prints it\)"

# (id, arguments, the error line as a regular expression, the user's line error.txt must show)
CASES = [
    ("forward", ["model._target_=usermod.Net", *NET],
     r"training step 1 failed in Net\.forward \(usermod\.py:12\): RuntimeError: mat1 and mat2 shapes cannot be "
     r"multiplied \(16x8 and 9x4\)", "usermod.py\", line 12"),
    ("dataset", ["data.train._target_=usermod.Data", "~data.train.n"],
     r"training step 3 failed in Data\.__getitem__ \(usermod\.py:34\): KeyError: 'sample 37 is missing'",
     "usermod.py\", line 34"),
    ("dataset-worker", ["data.train._target_=usermod.Data", "~data.train.n", "data.num_workers=1"],
     r"training step 3 failed in __getitem__ \(usermod\.py:34\): KeyError: 'sample 37 is missing'",
     "usermod.py\", line 34"),
    ("collate", ["+data.collate_fn._target_=usermod.collate"],
     r"training step 1 failed in collate \(usermod\.py:39\): ValueError: cannot collate", "usermod.py\", line 39"),
    # torch's default collate, none of the user's code below it: what to change is said (samples of one shape)
    ("ragged", ["data.train._target_=usermod.Ragged", "~data.train.n", "data.num_workers=1"],
     r"training step 1 failed: RuntimeError: stack expects each tensor to be equal size, but got \[8\] at entry 0 "
     r"and \[9\] at entry 1; torch's default collate could not make a batch of the dataset's samples: return "
     r"samples of one shape \(pad or crop them\), or batch them yourself with data.collate_fn \(a function of "
     r"the list of samples\)", "collate.py"),
    ("evaluation", ["model._target_=usermod.EvalFails", "~model.net", "~model.loss", "+model.dim=8"],
     r"the evaluation at step 3 failed in EvalFails\.forward \(usermod\.py:24\): ZeroDivisionError: only in "
     r"evaluation", "usermod.py\", line 24"),
    ("plugin", ["plugins.enable=[userplugin]"],
     r"training step 2 failed in plugin 'userplugin', hook 'on_train_step_end' \(userplugin\.py:7\): RuntimeError: "
     r"the plugin broke", "userplugin.py\", line 7"),
]
MISSPELT = ["model._target_=usermod.Misspelt", *NET, "+model.dim=8"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return fixtures.user_project(tmp_path_factory, MODULES)


def cli(project, *chains: list[list[str]]) -> list[list[dict]]:
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(project)))
    env.pop("HYDRA_FULL_ERROR", None)
    return run_chains([[{"argv": ["--config-dir", str(project / "conf"), *TINY, *argv]} for argv in chain]
                       for chain in chains], env, cwd=str(project))


@pytest.fixture(scope="module")
def results(project):
    argv = [[[*extra, f"hydra.run.dir=runs/{case}"]] for case, extra, _, _ in CASES]
    found = cli(project, *argv, [[*MISSPELT, "hydra.run.dir=runs/misspelt"]],
                [[*CASES[0][1], "debug=true", "hydra.run.dir=runs/debug"]])
    return {name: chain[0] for name, chain in zip([c[0] for c in CASES] + ["misspelt", "debug"], found)}


def error_lines(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if line.startswith("csframework: error:")]


@pytest.mark.slow
@pytest.mark.parametrize("case, _, line, user_line", CASES, ids=[c[0] for c in CASES])
def test_an_error_in_the_user_s_code_at_a_step_is_one_line_and_its_traceback_is_kept(project, results, case, _,
                                                                                    line, user_line):
    result = results[case]
    assert result["returncode"] == 1, result["stderr"][-3000:]
    [shown] = error_lines(result)
    assert re.fullmatch("csframework: error: " + line + SAVED.format(case=case), shown), shown
    # one line: not also the run's fit_failed event (issue 50 item 6); that is in events.jsonl
    assert [x for x in result["stderr"].splitlines() if "Error" in x] == [shown], result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    saved = (project / "runs" / case / "error.txt").read_text()
    assert saved.startswith(shown.removeprefix("csframework: error: ").split("; the traceback")[0])
    assert "Traceback (most recent call last)" in saved and user_line in saved, saved


@pytest.mark.slow
def test_a_forward_without_loss_is_refused_naming_the_keys_it_returned(results):
    result = results["misspelt"]
    assert result["returncode"] == 2, result["stderr"][-3000:]
    assert error_lines(result) == [
        "csframework: error: model.forward: usermod.Misspelt.forward(batch) returned a dict without a 'loss' key (its "
        "keys: 'los', 'logits'); return the loss tensor or a dict with a 'loss' key (and any other outputs, e.g. "
        "{'loss': loss, 'logits': logits})"], result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"]


@pytest.mark.slow
def test_debug_true_prints_the_traceback_of_the_user_s_error(results):
    result = results["debug"]
    assert result["returncode"] == 1
    assert "Traceback" in result["stderr"] and 'usermod.py", line 12, in forward' in result["stderr"]



def test_the_docs_show_the_line_a_user_sees():
    """docs/durability.md's example is the line the CLI prints for CASES' first case (its paths aside)."""
    shown = next(line for line in (ROOT / "docs" / "durability.md").read_text().splitlines()
                 if line.startswith("csframework: error: training step"))
    pattern = CASES[0][2].replace(r"usermod\.py:12", r"mymod\.py:11")
    assert re.fullmatch(f"csframework: error: {pattern}; the traceback is in \\S+/error\\.txt \\(debug=true prints "
                        "it\\)", shown), shown

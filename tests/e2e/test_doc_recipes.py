"""Every recipe of README.md and the pages of docs/ runs as written (issue 29 item 3). ``BLOCKS`` lists each fenced
block of those documents, named by its document and the start of its first line, with how it is run:

- ``Run``: its command lines run, in order, in one fresh working directory (``python`` is this
  interpreter; ``python -m csframework`` lines run in a fork server, ``torchrun`` lines as processes),
  each followed by ``SHORT`` (a few steps instead of hundreds; every other word is the document's); a
  line that cannot run here is named in ``skip`` with the reason; a line that names nothing of its working
  directory and that an earlier block had (the README's tour, the CLI reference and the guides repeat many)
  is not run again: its result is checked again (``runs_made``);
- ``Python``: the block runs as a script, after a ``prelude`` that defines what the block takes as given
  (the user's ``MyModel``, ``loader`` ...) and before ``after`` (code that uses what it defines);
- ``Config``: YAML that goes into a primary config of the user's (``defaults: [config, _self_]`` and the
  block), which then runs;
- ``UserFile``: a file of the user's project that a ``Run`` block's commands use (written from the document);
- ``Excerpt``: code shown from a file of this project, verbatim (its code lines, in order), which a test
  runs;
- ``Elsewhere``: run as written by another test (named);
- ``NotRunnable``: needs what this machine lacks (a GPU, a cluster, the network);
- ``NotARecipe``: a directory listing, a console message, pseudo-code.

A block that is not listed, or an entry whose block is gone, fails ``test_every_block_is_run_or_listed``:
a new recipe gets a test or a reason."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import fixtures
from doc_blocks import ROOT, Block, blocks, commands, documents, is_excerpt
from forkrun import run_chains

TORCHRUN = Path(sys.executable).with_name("torchrun")
#: Appended to every command line that runs: a few steps and a short evaluation (the documents' runs take
#: minutes); Hydra takes the last value of a key given twice.
SHORT = ["loop.max_steps=2", "loop.eval_every=2", "loop.eval_steps=1", "loop.log_every=1"]
SHORT_KEYS = {setting.split("=")[0] for setting in SHORT}


@dataclass(frozen=True)
class Run:
    setup: str = ""
    """A ``SETUPS`` function that prepares the working directory and returns environment additions."""
    skip: dict[str, str] = field(default_factory=dict)
    """A text of a command line -> why that line cannot run here."""
    again: bool = False
    """Run the (one) command a second time, as the block says (a sweep resumed with the same command)."""


@dataclass(frozen=True)
class Python:
    prelude: str = ""
    after: str = ""


@dataclass(frozen=True)
class Config:
    overrides: tuple[str, ...] = ()
    """Run with these after ``SHORT`` (the block's own step counts shortened too)."""


@dataclass(frozen=True)
class UserFile:
    used_by: str


@dataclass(frozen=True)
class Excerpt:
    path: str


@dataclass(frozen=True)
class Elsewhere:
    test: str
    how: str


@dataclass(frozen=True)
class NotRunnable:
    reason: str


@dataclass(frozen=True)
class NotARecipe:
    reason: str


GPU = "GPU: needs CUDA, which this machine (and CI) lacks; test_gpu.py covers device=gpu where there is one"
MY_PLUGIN = """
import csframework as csf

class MyPlugin:
    @csf.hookimpl
    def on_fit_end(self, run):
        print("MyPlugin: fit ended at step", run.global_step)
"""
TINY_FIT = """
cfg = csf.compose(["model=tiny_linear", "data=tiny_clusters", "loop.max_steps=10", "loop.eval_every=5",
                   "checkpoint.every_steps=10"])
csf.Run(cfg, plugins=[BestAccuracy], output_dir="outputs/best").fit()
saved = json.loads(next(Path("outputs/best/checkpoints").glob("step-*/meta.json")).read_text())
print("best", saved["plugins"]["best_accuracy"]["best"])
"""
HALVE = """
cfg = csf.compose(["model=tiny_linear", "data=tiny_clusters", "loop.max_steps=2", "optimizer=sgd",
                   "optimizer.schedule.name=cosine", "optimizer.schedule.min_lr=0.01"])
run = csf.Run(cfg, output_dir="outputs/halve")
run.fit()
before = run.optimizer.param_groups[0]["lr"]
HalveOnSpike().on_eval_end(run, {"val/loss": 11.0})
print("halved", before, run.optimizer.param_groups[0]["lr"])
"""
CSX_GIVEN = """
import torch
torch.manual_seed(0)

class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)

loader = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(3)]
"""

LSTM_GIVEN = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import csframework as csf
"""
#: The own-model page's stateful model trained a few batches of a batchified stream, then resumed mid-epoch.
LSTM_FIT = """
def stream():
    tokens = torch.randint(0, 33, (201, 4), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:-1], tokens[1:])

def fit(*more):
    cfg = csf.compose(["model=tiny_linear", "data=tiny_clusters", "~model.net", "~model.loss",
                       "model._target_=__main__.WordLSTM", "data.train._target_=__main__.stream",
                       "data.val._target_=__main__.stream", "~data.train.n", "~data.val.n", "~data.val.seed",
                       "data.batch_size=35", "data.shuffle=false",
                       "loop.max_steps=7", "loop.eval_every=null", "loop.eval_steps=null", "checkpoint.keep_last=3",
                       "checkpoint.every_steps=6", "optimizer=sgd", "optimizer.lr=1", *more])
    run = csf.Run(cfg, output_dir="outputs/" + str(len(more)))
    run.fit()
    return run

straight, resumed = fit(), fit("checkpoint.resume=outputs/0/checkpoints/step-00000006")
assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))
print("carried", straight.metrics["val/loss"])
"""
PERPLEXITY_FIT = """
cfg = csf.compose(["model=tiny_linear", "data=tiny_clusters", "loop.max_steps=4", "loop.eval_every=2"])
summary = csf.Run(cfg, plugins=[Perplexity()], output_dir="outputs/ppl").fit()
print("ppl", summary["metrics"]["val/ppl"])
"""

#: (document, the start of the block's first line) -> how the block is run, or why it is not.
BLOCKS: dict[tuple[str, str], object] = {
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 "): NotRunnable(
        "network: makes a virtual environment and installs torch and csframework from PyPI (test_readme checks "
        "that it ends with `python -m csframework`, which the tour runs)"),
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch"): NotRunnable(
        "network: installs every extra from PyPI; CI runs this very line (.ci/run, test_readme)"),
    ("README.md", "python -m csframework                                                # the embedded default"): Run(
        setup="tour"),
    ("README.md", 'pip install -e ".[docs]" && mkdocs serve'): NotRunnable(
        "network: installs the docs extra from PyPI; CI builds the site (.ci/run) and test_docs_site.py checks it"),
    ("docs/reference/cli.md", "python -m csframework                                    # the embedded default"): Run(),
    ("docs/getting-started/index.md", "python -m csframework optimizer=sgd optimizer.lr=0.05"): Run(),
    # as written, nothing before it: a newcomer pastes it whole (it named a MyPlugin it did not define)
    ("docs/getting-started/index.md", "import csframework as csf\n\ncfg = csf.compose"): Python(),
    ("docs/getting-started/own-model.md", "conf/model/my_model.yaml"): NotARecipe(
        "the two files in brief; the user_project setup writes them in full"),
    ("docs/getting-started/own-model.md", "python -m csframework --config-dir conf model=my_model data=my_data"): Run(
        setup="user_project"),
    ("docs/getting-started/own-model.md", "# conf/my_run.yaml"): UserFile(
        used_by="python -m csframework --config-dir conf model=my_model"),
    ("docs/getting-started/own-model.md", "class WordLSTM(nn.Module):"): Python(prelude=LSTM_GIVEN, after=LSTM_FIT),
    ("docs/guides/training.md", "metrics:\n  mae:"): Elsewhere(
        "tests/unit/test_eval_metrics.py", "builds every entry of the block; its other tests run such metrics"),
    ("docs/guides/training.md", "class Perplexity:"): Python(prelude="import math\nimport csframework as csf\n",
                                                      after=PERPLEXITY_FIT),
    ("docs/concepts/index.md", "on_fit_start"): NotARecipe("pseudo-code: the order of the hooks"),
    ("docs/concepts/validation.md", "csframework: error: model._target_: brokenmd.MLP: no module "): Elsewhere(
        "tests/e2e/test_user_code_errors.py", "the CLI prints these lines (checked against the page there)"),
    ("docs/guides/configs.md", "python -m csframework optimizer=sgd optimizer.lr=0.05 optimizer.schedule"): Run(),
    ("docs/guides/configs.md", "python -m csframework optimizer._target_=torch.optim.RMSprop"): Run(),
    ("docs/guides/configs.md", "def __getbatch__(self, indices):"): NotARecipe(
        "a method of the user's dataset, shown alone; tests/unit/test_batched.py runs datasets with one"),
    ("docs/guides/configs.md", "stages:"): Config(("stages.warmup.loop.max_steps=2", "stages.main.loop.max_steps=3")),
    ("docs/guides/configs.md", "# plain SGD, its rate divided by 4"): Run(),
    ("docs/guides/configs.md", "import csframework as csf\n\n\nclass HalveOnSpike"): Python(after=HALVE),
    ("docs/guides/configs.md", "python -m csframework model=tiny_linear data=tiny_clusters checkpoint.keep_best"): Run(),
    ("docs/guides/regression.md", "csframework: error: model.loss=mse"): Elsewhere(
        "tests/unit/test_models.py", "the run's error line, checked against the page there"),
    ("docs/guides/regression.md", "# conf/model/linear_regression.yaml"): Elsewhere(
        "tests/unit/test_models.py", "composed as the page's model group file and trained there"),
    ("docs/guides/regression.md", "import csframework as csf\n\n\nclass RegressionMetrics"): Elsewhere(
        "tests/unit/test_models.py", "registered in a run there, its R² checked by hand"),
    ("docs/guides/writing-plugins.md", "import csframework as csf\n\nclass BestAccuracy"): Python(
        prelude="import json\nfrom pathlib import Path\n", after=TINY_FIT),
    ("docs/guides/writing-plugins.md", "csframework-target/"): NotARecipe(
        "the layout of the plugin package the next blocks spell out"),
    ("docs/guides/writing-plugins.md", "# csframework-target/pyproject.toml"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/writing-plugins.md", "# csframework-target/src/csf_target/__init__.py"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/writing-plugins.md", "# csframework-target/tests/test_target.py"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/checkpoints.md", "python -m csframework checkpoint.every_steps=50"): Run(),
    ("docs/guides/training.md", 'python -m csframework "+optimizer.groups.embeddings'): Run(),
    ("docs/guides/checkpoints.md", "cd examples/classify"): Elsewhere(
        "tests/e2e/test_weights_out.py", "trained as written"),
    ("docs/guides/checkpoints.md", "import torch"): Elsewhere(
        "tests/e2e/test_weights_out.py", "run as written after that training"),
    ("docs/guides/checkpoints.md", "model = csf.load_model("): Elsewhere(
        "tests/e2e/test_weights_out.py", "run as written after the recipe before it"),
    ("docs/guides/checkpoints.md", "python -m csframework --config-dir conf +experiment=spirals mode=predict"): Elsewhere(
        "tests/e2e/test_weights_out.py", "run as written after that training"),
    ("docs/guides/checkpoints.md", '{"index": 0,'): Elsewhere(
        "tests/e2e/test_weights_out.py", "its keys are those of the file the block before it writes"),
    ("docs/guides/compiling.md", "python -m csframework backend.compile=true "): Run(skip={"device=gpu": GPU}),
    ("docs/architecture.md", "10 the command line"): NotARecipe("the floors, their modules and what each does"),
    ("docs/architecture.md", "for each micro-batch"): NotARecipe("pseudo-code of one optimizer step"),
    ("docs/guides/backends.md", "python -m csframework device=toy"): Run(setup="toy_backend"),
    ("docs/guides/backends.md", "toy_backend/"): NotARecipe("the layout of tests/support/toy_backend"),
    ("docs/guides/backends.md", '[project.entry-points."csframework.plugins"]'): UserFile(
        used_by="python -m csframework device=toy"),
    ("docs/guides/backends.md", "@dataclass"): Excerpt("tests/support/toy_backend/plugin.py"),
    ("docs/guides/backends.md", "class ToyBackend(BackendBase):"): Excerpt("tests/support/toy_backend/plugin.py"),
    ("docs/guides/backends.md", 'SPEC = BackendSpec("TOY"'): Excerpt("tests/support/toy_backend/plugin.py"),
    ("docs/guides/backends.md", 'SPEC = BackendSpec("CSX", CerebrasBackendConfig'): Excerpt(
        "plugins/csframework-cerebras/src/csframework_cerebras/plugin.py"),
    ("docs/guides/cerebras.md", "python -m csframework backend=cerebras backend.type=CPU"): NotRunnable(
        "network: needs cerebras-pytorch 2.10 from PyPI (8 GB, a venv of its own with torch 2.4), which CI builds "
        "(.ci/cerebras) and runs these settings in (plugins/csframework-cerebras/tests); the last line needs a "
        "cluster"),
    ("docs/guides/csx.md", "python -m csframework device=csx "): Run(),
    ("docs/guides/csx.md", "import torch, csframework as csf"): Python(prelude=CSX_GIVEN),
    ("docs/guides/csx.md", "[2026-11-29 "): NotARecipe("the log lines the headline command prints"),
    ("docs/guides/distributed.md", "torchrun --nproc_per_node=2 -m csframework backend.strategy=ddp"): Run(),
    ("docs/guides/distributed.md", "csframework: rank 0: another rank died"): NotARecipe("the message a rank prints"),
    ("docs/durability.md", "csframework: error: run directory /home/me/runs/a holds a run"): Elsewhere(
        "tests/e2e/test_rerun_cli.py", "the CLI prints this line (the test checks it, its paths the test's)"),
    ("docs/durability.md", "csframework: error: checkpoint.start_over=true: cannot move"): Elsewhere(
        "tests/unit/test_fresh_run.py", "a start over prints this line (the test checks it, its paths the test's)"),
    ("docs/durability.md", "csframework: error: training step 1 failed in Net.forward"): Elsewhere(
        "tests/e2e/test_user_runtime_errors.py", "the CLI prints this line (checked against the page there)"),
    ("docs/guides/distributed.md", "torchrun --nproc_per_node=2 --max-restarts=3 --rdzv-backend=c10d"): Run(),
    ("docs/guides/distributed.md", "# on each of 2 nodes"): NotRunnable(
        "cluster: two machines (node0 and another); test_distributed.py runs two nodes on localhost"),
    ("docs/guides/distributed.md", "#!/bin/bash"): NotRunnable("cluster: a SLURM batch script (sbatch), GPU nodes"),
    ("docs/guides/distributed.md", "python -m csframework -m hydra/launcher=submitit_slurm"): NotRunnable(
        "cluster: submits to SLURM, GPU nodes"),
    ("docs/guides/plugins.md", "csframework-best-metric/"): NotARecipe("the layout of the package the next blocks spell out"),
    ("docs/guides/plugins.md", "# csframework-best-metric/pyproject.toml"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/plugins.md", "# csframework-best-metric/src/csf_best_metric/__init__.py"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/plugins.md", "# csframework-best-metric/tests/test_best_metric.py"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "installs the package these blocks spell out and runs its tests"),
    ("docs/guides/plugins.md", "pip install ./csframework-best-metric && python -m pytest"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "pip-installs the package (into a target directory, leaving the "
        "test's environment as it was) and runs its tests with pytest"),
    ("docs/guides/plugins.md", "<!-- csframework-best-metric/README.md -->"): Elsewhere(
        "tests/e2e/test_plugin_recipes.py", "the package's README, part of the package it installs"),
    ("docs/guides/sweeps.md", "python -m csframework -m optimizer=sgd,adamw optimizer.lr=1e-3,3e-3 loop.max_steps=100"): Run(),
    ("docs/guides/sweeps.md", "python -m csframework -m hydra/launcher=joblib"): Run(),
    ("docs/guides/sweeps.md", "csframework: sweep ended: "): NotARecipe("the closing line a sweep prints"),
    ("docs/guides/sweeps.md", "python -m csframework -m hydra/launcher=submitit_local"): Run(),
    ("docs/guides/sweeps.md", "python -m csframework -m hydra/launcher=submitit_slurm"): NotRunnable(
        "cluster: submits to SLURM, GPU nodes"),
    ("docs/guides/sweeps.md", "python -m csframework -m hydra/launcher=ray optimizer=sgd,adamw"): Run(skip={
        "ray://head-node": "cluster: connects to a Ray cluster's head node"}),
    ("docs/guides/sweeps.md", "python -m csframework -m hydra/sweeper=optuna"): Run(),
    ("docs/guides/sweeps.md", "python -m csframework -m optimizer.lr=1e-3,3e-3,1e-2"): Run(again=True),
}


def entry(block: Block) -> tuple[tuple[str, str], object] | None:
    found = [(key, how) for key, how in BLOCKS.items() if key[0] == block.document and block.text.startswith(key[1])]
    assert len(found) <= 1, f"{block}: listed {len(found)} times in BLOCKS"
    return found[0] if found else None


def all_blocks() -> list[Block]:
    return [block for document in documents() for block in blocks(document)]


def listed(kind: type) -> list[Block]:
    return [block for block in all_blocks() if isinstance((entry(block) or (None, None))[1], kind)]


def block_named(document: str, start: str) -> Block:
    return next(b for b in blocks(document) if b.text.startswith(start))


def test_every_block_is_run_or_listed():
    missing = [str(block) for block in all_blocks() if entry(block) is None]
    assert not missing, "blocks of the documents that no test runs and BLOCKS does not list:\n" + "\n".join(missing)
    found = {entry(block)[0] for block in all_blocks()}
    assert not set(BLOCKS) - found, f"BLOCKS lists blocks the documents no longer have: {set(BLOCKS) - found}"
    for key, how in BLOCKS.items():
        if isinstance(how, NotRunnable):
            assert how.reason.split(":")[0] in ("GPU", "cluster", "network"), key
        if isinstance(how, Elsewhere):
            assert key[0] in (ROOT / how.test).read_text(), f"{how.test} does not name {key[0]}"
        if isinstance(how, Run):
            lines = [" ".join(argv) for argv in commands(block_named(*key))]
            for text in how.skip:
                assert sum(text in line for line in lines) == 1, (key, text)
            for text, reason in how.skip.items():
                assert reason.split(":")[0] in ("GPU", "cluster", "network"), (key, text)


@pytest.mark.parametrize("block", listed(Excerpt), ids=str)
def test_a_shown_excerpt_is_the_code_of_its_file(block):
    path = entry(block)[1].path
    assert is_excerpt(block.text, (ROOT / path).read_text()), f"{block} is no longer what {path} holds"


# -- running the blocks ---------------------------------------------------------------------------------------
def user_project(work: Path) -> dict:
    """A user's project as the own-model page's block assumes it: a model of their own (a byte-level
    bigram model with no ``block_size``), data of their own, and the primary config the page shows."""
    (work / "my_models.py").write_text(textwrap.dedent("""\
        import torch

        class Bigram(torch.nn.Module):
            def __init__(self, vocab_size: int = 256):
                super().__init__()
                self.table = torch.nn.Embedding(vocab_size, vocab_size)

            def forward(self, batch):
                inputs, targets = batch
                return torch.nn.functional.cross_entropy(self.table(inputs).flatten(0, 1), targets.flatten())
        """))
    (work / "conf" / "model").mkdir(parents=True)
    (work / "conf" / "model" / "my_model.yaml").write_text("_target_: my_models.Bigram\n")
    (work / "conf" / "data").mkdir()
    (work / "conf" / "data" / "my_data.yaml").write_text(textwrap.dedent("""\
        train: {_target_: csframework.defaults.StdlibText, split: train, block_size: 32, num_chars: 100000}
        val: {_target_: csframework.defaults.StdlibText, split: val, block_size: 32, num_chars: 20000}
        batch_size: 16
        """))
    my_run = block_named("docs/getting-started/own-model.md", "# conf/my_run.yaml")
    (work / "conf" / "my_run.yaml").write_text(my_run.text)
    return {"PYTHONPATH": fixtures.pythonpath(str(work))}


def toy_backend(work: Path) -> dict:
    """The toy backend package of tests/support installed as pip leaves it, its entry point from the
    ``[project.entry-points]`` block of docs/guides/backends.md."""
    points = tomllib.loads(block_named("docs/guides/backends.md", '[project.entry-points.').text)
    info = work / "site" / "toy_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    group = points["project"]["entry-points"]["csframework.plugins"]
    (info / "entry_points.txt").write_text("[csframework.plugins]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in group.items()))
    return {"PYTHONPATH": fixtures.pythonpath(str(work / "site")), "CSFRAMEWORK_PLUGINS_AUTOLOAD": ",".join(group)}


def tour(work: Path) -> dict:
    """What the README's tour takes as given: the user's project (``user_project``) and a plugin of theirs
    in ``my_plugin.py``."""
    (work / "my_plugin.py").write_text(textwrap.dedent(MY_PLUGIN))
    return user_project(work)


SETUPS = {"user_project": user_project, "toy_backend": toy_backend, "tour": tour}


def run_commands(argvs: list[list[str]], work: Path, env: dict) -> list[dict]:
    """Each command in ``work``, in order: consecutive ``python -m csframework`` lines in one fork server
    (the Ray launcher's in a process of its own), the others as processes."""
    results: list[dict] = []
    pending: list[list[str]] = []

    def flush():
        if pending:
            time.sleep(1 - time.time() % 1)  # after a command run as a process: not in its second
            # each in a second of its own, as typed: two in one second would share Hydra's dated run directory
            results.extend(run_chains([[{"argv": argv, "new_second": True} for argv in pending]], env, parallel=1,
                                      timeout=1800,
                                      cwd=str(work))[0])
            pending.clear()

    for argv in argvs:
        if argv[:3] == ["python", "-m", "csframework"] and "hydra/launcher=ray" not in argv:
            pending.append(argv[3:] + SHORT)
            continue
        flush()
        time.sleep(1 - time.time() % 1)  # a second of its own, as typed (Hydra's dated run directory)
        program = {"python": sys.executable, "torchrun": str(TORCHRUN)}[argv[0]]
        done = subprocess.run([program, *argv[1:], *SHORT], env=env, cwd=work, capture_output=True, text=True,
                              timeout=900)
        results.append({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr})
    flush()
    return results


@pytest.fixture(scope="module")
def runs_made() -> dict:
    """A command line's result, for the lines that several blocks have (the README's tour, the CLI
    reference and the guides repeat many): each runs once, and every block that has it checks that result.
    Keyed by ``shared_key``."""
    return {}


def shared_key(argv: list[str], work: Path, setup_env: dict) -> tuple | None:
    """What a command line's result depends on, or ``None`` when another block's run of the same text may
    differ: the line names something of its working directory (a file the setup wrote, a run or sweep
    directory, a checkpoint to resume), whose state earlier lines of its own block make. Otherwise the
    result depends on the text and the setup's environment only (its ``PYTHONPATH`` adds the working
    directory, whose modules the line does not name). A setting that ``SHORT`` gives again is left out of
    the text: the run takes ``SHORT``'s value."""
    text = " ".join(arg for arg in argv if not (arg.split("=")[0] in SHORT_KEYS and arg.split("=", 1)[-1].isdigit()))
    names = {entry.name.split(".")[0] for entry in work.iterdir()}
    if "resume=" in text or ".dir=" in text or any(name in text for name in names):
        return None
    return text, tuple(sorted((k, v) for k, v in setup_env.items() if k != "PYTHONPATH"))


def test_only_a_line_that_names_nothing_of_its_working_directory_is_shared(tmp_path):
    """The README's tour and the CLI reference share their runs of the default and of ``mode=check``, but not
    of a line that writes a run directory a later line of the block reads, nor of one naming the user's files."""
    bare, users = tmp_path / "bare", tmp_path / "tour"
    bare.mkdir()
    users.mkdir()
    users_env = tour(users)
    cli = ["python", "-m", "csframework"]
    assert shared_key([*cli, "mode=check"], users, users_env) == shared_key([*cli, "mode=check"], bare, {}) is not None
    for line in ("checkpoint.resume=auto hydra.run.dir=outputs/my-run", "hydra.sweep.dir=multirun/lr x=1",
                 "plugins.enable=[my_plugin:MyPlugin]", "--config-dir conf model=my_model"):
        assert shared_key([*cli, *line.split()], users, users_env) is None, line
    assert shared_key(cli, bare, {"CSFRAMEWORK_PLUGINS_AUTOLOAD": "toy"}) != shared_key(cli, bare, {}), \
        "a setup's other settings change a run"
    joblib = [*cli, "-m", "hydra/launcher=joblib", "optimizer=sgd,adamw"]
    assert shared_key([*joblib, "loop.max_steps=100"], bare, {}) == shared_key(joblib, bare, {})  # SHORT's steps
    assert shared_key([*joblib, "loop.max_steps=100,200"], bare, {}) != shared_key(joblib, bare, {}), \
        "a sweep over a setting SHORT gives is a sweep still"


@pytest.mark.slow
@pytest.mark.parametrize("block", listed(Run), ids=str)
def test_the_commands_of_a_block_run_as_written(block, tmp_path, cli_env, runs_made):
    how = entry(block)[1]
    work = tmp_path / "work"
    work.mkdir()
    setup_env = SETUPS[how.setup](work) if how.setup else {}
    env = dict(cli_env, **setup_env)
    argvs = [argv for argv in commands(block) if not any(text in " ".join(argv) for text in how.skip)]
    if how.again:
        assert len(argvs) == 1, block
        argvs *= 2
    if any(argv[0] == "torchrun" for argv in argvs) and not TORCHRUN.exists():
        pytest.skip("torchrun not found")
    keys = [None if how.again else shared_key(argv, work, setup_env) for argv in argvs]
    to_run = [argv for argv, key in zip(argvs, keys) if key is None or key not in runs_made]
    ran = iter(run_commands(to_run, work, env))
    results = []
    for argv, key in zip(argvs, keys):
        result = runs_made[key] if key is not None and key in runs_made else next(ran)
        if key is not None:
            runs_made[key] = result
        results.append(result)
    for argv, result in zip(argvs, results):
        assert result["returncode"] == 0 and "Traceback" not in result["stderr"], \
            f"{' '.join(argv)}:\n{result['stderr'][-3000:]}"
    if how.again:  # the same command again: every job completed before is not run again
        assert result["stderr"].count("completed before; not run again") == 3, result["stderr"][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("block", listed(Python), ids=str)
def test_a_python_recipe_runs_as_written(block, tmp_path, cli_env):
    how = entry(block)[1]
    script = tmp_path / "recipe.py"
    script.write_text("\n".join([textwrap.dedent(how.prelude), block.text, textwrap.dedent(how.after)]))
    done = subprocess.run([sys.executable, str(script)], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    if block.text.startswith("import csframework as csf\n\ncfg"):  # the Python API of getting started
        assert done.stdout.splitlines()[-1].startswith("completed ")
    elif "HalveOnSpike" in block.text:  # run.scale_lr through the schedule: half the cosine rate
        before, after = map(float, done.stdout.split()[-2:])
        assert after == before / 2 and before > 0, done.stdout
    elif "BestAccuracy" in block.text:
        assert 0 < float(done.stdout.split()[-1]) <= 1, done.stdout
    elif "WordLSTM" in block.text:  # trained, and resumed in the middle of its epoch to the same weights
        assert done.stdout.splitlines()[-1].startswith("carried "), done.stdout
    elif "class Perplexity" in block.text:
        assert float(done.stdout.split()[-1]) > 1, done.stdout
    else:  # the CSX low-level API: a loss printed by the step closure after each of the 3 steps
        assert len([line for line in done.stdout.splitlines() if line.startswith("loss ")]) == 3, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("block", listed(Config), ids=str)
def test_a_config_recipe_runs_as_written(block, tmp_path, cli_env):
    how = entry(block)[1]
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "recipe.yaml").write_text("defaults: [config, _self_]\n" + block.text)
    done = subprocess.run([sys.executable, "-m", "csframework", "--config-dir", "conf", "--config-name", "recipe",
                           *SHORT, *how.overrides, "hydra.run.dir=run"], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["stage"] == "main"


def test_the_readme_primary_config_recipe_composes_with_a_model_of_the_users_own(tmp_path):
    """The own-model page's template (defaults: [config, {override model: my_model}, {override data: my_data},
    _self_]) with a model that is not
    the transformer composes, the built-in data included (it failed: data.train.block_size: Interpolation key
    'model.block_size' not found)."""
    import csframework as csf

    user_project(tmp_path)
    cfg = csf.compose([], config_dir=str(tmp_path / "conf"), config_name="my_run")
    assert cfg.model["_target_"] == "my_models.Bigram" and cfg.data.train["block_size"] == 32  # the user's data
    assert (cfg.optimizer.lr, cfg.loop.max_steps) == (1e-3, 1000)
    cfg = csf.compose(["data=stdlib_text"], config_dir=str(tmp_path / "conf"), config_name="my_run")
    assert cfg.data.train["block_size"] == 64  # the built-in data composes with it too


def test_the_run_directory_section_names_everything_a_run_leaves(tmp_path):
    """Issue 29 item 7: the lock file (and every other entry a run leaves in its directory) is documented in
    "What a run leaves" of docs/getting-started/run-directory.md."""
    fixtures.fit(tmp_path, "checkpoint.every_steps=8")
    page = (ROOT / "docs/getting-started/run-directory.md").read_text()
    section = page[page.index("## What a run leaves"):page.index("## Logging")]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert ".csframework.lock" in left
    assert [name for name in left if f"`{name}" not in section] == [], section
    assert "stays after the run" in section

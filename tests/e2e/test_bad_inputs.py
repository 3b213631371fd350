"""The bad-input corpus: every case exits non-zero with a one-line message naming the key or file, without a
traceback, and writes no checkpoint.

All cases run the CLI (``csframework.__main__.main`` with the case's argv, in a fresh forked process each,
through ``forkrun``); the Hydra-level ones also run as plain ``python -m csframework`` subprocesses.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fixtures
from fixtures import CONF
from forkrun import run_chains

pytestmark = pytest.mark.slow

BASE = ["model=blobs_mlp", "data=blobs", "loop.max_steps=2", "loop.eval_every=null", "loop.eval_steps=null"]

# (id, extra command-line arguments, what the message must name). {conf} is the user config directory.
CASES = [
    # overrides with wrong types
    ("int-from-word", ["loop.max_steps=abc"], "loop.max_steps"),
    ("int-from-float", ["seed=1.5"], "seed"),
    ("float-from-word", ["optimizer.lr=fast"], "optimizer.lr"),
    ("bool-from-word", ["data.shuffle=maybe"], "data.shuffle"),
    ("section-from-int", ["loop=3"], "loop"),
    ("null-for-required", ["data.batch_size=null"], "data.batch_size"),
    ("list-from-word", ["plugins.enable=foo"], "plugins.enable"),
    ("int-from-list", ["checkpoint.keep_last=[1,2]"], "checkpoint.keep_last"),
    # unknown keys and groups
    ("unknown-key", ["loop.max_stepz=3"], "loop.max_stepz"),
    ("unknown-group", ["nogroup=x"], "nogroup"),
    ("added-root-key", ["+foo=1"], "foo"),
    ("added-section-key", ["+loop.patience=3"], "loop.patience"),
    ("unknown-optimizer", ["optimizer=nope"], "optimizer: no option 'nope'"),
    ("unknown-model", ["model=nope"], "model: no option 'nope'"),
    ("unknown-device", ["device=tpu"], "device: no option 'tpu'"),
    ("unknown-precision", ["precision=float8"], "precision: no option 'float8'"),
    ("unknown-backend-key", ["backend.turbo=true"], "backend.turbo"),
    ("bad-enum", ["optimizer.schedule.name=wavy"], "optimizer.schedule.name"),
    ("bad-mode", ["mode=train"], "mode"),
    ("disable-unknown-plugin", ["plugins.disable=[nosuch]"], "plugins.disable"),
    # contradictions between device, backend, precision, optimizer and stages
    ("device-and-backend", ["device=gpu", "backend=csx"], "device, backend"),
    ("csx-setting-on-cpu", ["backend.compile_only=true"], "backend.compile_only"),
    ("ddp-on-csx", ["device=csx", "backend.strategy=ddp"], "backend.strategy"),
    ("cbfloat16-on-cpu", ["precision=cbfloat16"], "precision: cbfloat16 needs device=csx"),
    ("float16-unscaled", ["precision=float16", "precision.loss_scaling=null"], "precision.loss_scaling"),
    ("bfloat16-scaled", ["precision=bfloat16", "precision.loss_scaling=dynamic"], "precision.loss_scaling"),
    ("no-length", ["loop.max_steps=null"], "loop.max_steps, loop.max_epochs"),
    ("stage-on-other-device", ["+stages={warmup:{device:csx},main:{loop:{max_steps:2}}}"], "stages.warmup.device"),
    ("stage-name-with-a-separator", ["device=csx", "+stages={a/b:{loop:{max_steps:2}}}"], "stages.a/b"),
    ("compile-a-number", ["backend.compile=2"], "backend.compile: 2 is a number"),
    ("compile-whole-step-a-negative-number", ["backend.compile_whole_step=-1"], "backend.compile_whole_step"),
    ("sgd-with-betas", ["optimizer=sgd", "optimizer.betas=[0.9,0.99]"], "optimizer.betas"),
    # issue 47 round five: numbers for booleans outside backend.*, containers in lists, float32 overflows
    ("start-over-a-number", ["checkpoint.start_over=2"], "checkpoint.start_over: 2 is a number"),
    ("start-over-a-negative-number", ["checkpoint.start_over=-1"], "checkpoint.start_over: -1 is a number"),
    ("exclude-a-mapping", ["optimizer.weight_decay_exclude=[{a:1}]"], "optimizer.weight_decay_exclude[0]"),
    ("group-params-a-mapping", ["+optimizer.groups.h.params=[{a:1}]"], "optimizer.groups.h.params[0]"),
    ("lr-beyond-float32", ["optimizer.lr=1e300"], "optimizer.lr: 1e+300"),
    ("lr-scale-beyond-float32", ["+optimizer.groups.h.params=[net.*]", "+optimizer.groups.h.lr_scale=1e300"],
     "optimizer.groups.h.lr_scale"),
    # out-of-range numbers
    ("negative-steps", ["loop.max_steps=-1"], "loop.max_steps"),
    ("negative-lr", ["optimizer.lr=-0.1"], "optimizer.lr"),
    ("zero-batch", ["data.batch_size=0"], "data.batch_size"),
    ("batch-larger-than-data", ["data.batch_size=100000"], "data.batch_size"),
    ("keep-none", ["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    ("zero-accumulation", ["loop.grad_accum_steps=0"], "loop.grad_accum_steps"),
    ("min-lr-above-lr", ["optimizer.schedule.min_lr=5"], "optimizer.schedule.min_lr"),
    ("negative-workers", ["data.num_workers=-2"], "data.num_workers"),
    ("zero-checkpoint-interval", ["checkpoint.every_steps=0"], "checkpoint.every_steps"),
    # missing files and targets
    ("missing-resume-path", ["checkpoint.resume=/nonexistent/step-00000001"], "checkpoint.resume"),
    ("missing-config-dir", ["--config-dir", "/nonexistent/conf"], "/nonexistent/conf"),
    ("missing-config-name", ["--config-name", "nope"], "'nope'"),
    ("missing-dataset-class", ["data.train._target_=nope.Data"], "nope.Data"),
    ("missing-model-class", ["model.net._target_=nope.Net"], "nope.Net"),
    # broken user config files
    ("invalid-yaml", ["data=broken"], "{conf}/data/broken.yaml"),
    ("tab-in-yaml", ["model=tabbed"], "{conf}/model/tabbed.yaml"),
    ("wrong-type-in-file", ["data=badtype"], "data.batch_size"),
    # plugins that do not import
    ("plugin-missing", ["plugins.enable=[no_such_plugin_module]"], "no_such_plugin_module"),
    ("plugin-import-error", ["plugins.enable=[broken_plugin]"], "broken_plugin"),
    ("plugin-syntax-error", ["plugins.enable=[syntax_error_plugin]"], "syntax_error_plugin"),
    ("plugin-missing-class", ["plugins.enable=[fixtures:NoSuchPlugin]"], "fixtures:NoSuchPlugin"),
    # unparsable overrides
    ("unparsable", ["loop.max_steps=[1"], "loop.max_steps=[1"),
]
HYDRA_LEVEL = ["unknown-key", "invalid-yaml", "unparsable"]
NOT_RUNS = [(["--help"], "csframework"), (["--cfg", "job", "loop.max_steps=7"], "max_steps: 7")]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A user config directory (the test configs plus broken files) and a directory of broken plugins."""
    root = tmp_path_factory.mktemp("user")
    conf = root / "conf"
    shutil.copytree(CONF, conf)
    (conf / "data" / "broken.yaml").write_text("train:\n  _target_: fixtures.Blobs\n  n: [1, 2\nbatch_size: 4\n")
    (conf / "data" / "badtype.yaml").write_text("defaults:\n  - blobs\n  - _self_\nbatch_size: many\n")
    (conf / "model" / "tabbed.yaml").write_text("_target_: fixtures.mlp\n\thidden: 3\n")
    plugins = root / "plugins"
    plugins.mkdir()
    (plugins / "broken_plugin.py").write_text("raise ImportError('needs the frobnicate package')\n")
    (plugins / "syntax_error_plugin.py").write_text("def hook(:\n")
    return conf, plugins


def _env(cli_env, plugins: Path) -> dict:
    env = dict(cli_env)
    env["PYTHONPATH"] = os.pathsep.join([str(plugins), env["PYTHONPATH"]])
    return env


def _argv(conf: Path, run_dir: Path, extra: list[str]) -> list[str]:
    options = extra if extra[0].startswith("--") else []  # e.g. --config-name nope: before the overrides
    overrides = [] if options else extra
    if "--config-dir" not in options:
        options = ["--config-dir", str(conf), *options]
    return options + BASE + overrides + [f"hydra.run.dir={run_dir}"]


def check(case: str, expected: str, returncode: int, stderr: str, run_dir: Path) -> None:
    assert returncode > 0, f"{case}: exit status {returncode}\n{stderr}"
    assert "Traceback" not in stderr, f"{case}: traceback\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("csframework: error:")]
    assert len(errors) == 1, f"{case}: expected one error line\n{stderr}"
    others = [line for line in lines if not line.startswith(("csframework: error:", "  - "))]
    assert not others, f"{case}: lines besides the error\n{stderr}"
    assert expected in stderr, f"{case}: the message does not name {expected!r}\n{stderr}"
    if len(lines) == 1:
        assert expected in errors[0]
    assert not (run_dir / "checkpoints").exists(), f"{case}: a checkpoint directory was written"


def test_the_corpus_has_at_least_30_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, user_files):
    """Every case, and the commands that are not runs, through one ``forkrun`` driver."""
    conf, plugins = user_files
    tmp = tmp_path_factory.mktemp("corpus")
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(plugins)))
    env.pop("HYDRA_FULL_ERROR", None)
    chains = [[{"argv": _argv(conf, tmp / case, extra)}] for case, extra, _ in CASES]
    chains += [[{"argv": argv}] for argv, _ in NOT_RUNS]
    results = [chain[0] for chain in run_chains(chains, env)]
    return tmp, results[:len(CASES)], results[len(CASES):]


def test_every_bad_input_is_one_line_naming_the_key_without_traceback_or_checkpoint(corpus, user_files):
    tmp, results, _ = corpus
    conf, _ = user_files
    failures = []
    for (case, _, expected), result in zip(CASES, results):
        try:
            check(case, expected.format(conf=conf), result["returncode"], result["stderr"], tmp / case)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)


def test_commands_that_are_not_runs_still_work(corpus):
    for (argv, needle), result in zip(NOT_RUNS, corpus[2]):
        assert result["returncode"] == 0 and needle in result["stdout"], (argv, result["stderr"])


def test_hydra_level_errors_through_python_dash_m(tmp_path, cli_env, user_files):
    conf, plugins = user_files
    env = _env(cli_env, plugins)
    cases = [c for c in CASES if c[0] in HYDRA_LEVEL]

    def run(case):
        name, extra, _ = case
        return subprocess.run([sys.executable, "-m", "csframework", *_argv(conf, tmp_path / name, extra)],
                              env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, cases))
    for (name, _, expected), result in zip(cases, results):
        check(name, expected.format(conf=conf), result.returncode, result.stderr, tmp_path / name)
        assert result.returncode == 2, name

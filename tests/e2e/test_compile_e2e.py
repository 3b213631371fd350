"""``backend.compile=true`` end to end: a compiled run killed (SIGKILL) and resumed ends with the parameters of
the uninterrupted compiled run; two DDP ranks (gloo) compiled train as one eager process with the whole batch;
the CLI refuses a graph break under ``compile_fullgraph=true`` with one line and exit status 2."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fixtures
from forkrun import run_chains
from durable_runs import ARGS, assert_same, final_params

pytestmark = pytest.mark.slow

COMPILED = ARGS + ["backend.compile=true"]
KILLS = ["after_backward@4", "batch_end@9", "eval@10", "checkpoint_save@12"]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_a_killed_compiled_run_resumes_bit_identical(tmp_path, cli_env):
    chains = [[{"argv": COMPILED + [f"hydra.run.dir={tmp_path / 'reference'}"], "env": {}, "collect": []}]]
    for point in KILLS:
        run_dir = tmp_path / point.replace("@", "-")
        argv = COMPILED + [f"hydra.run.dir={run_dir}"]
        chains.append([{"argv": argv, "env": {"CSF_TEST_KILL": point}, "collect": []},
                       {"argv": argv, "env": {}, "collect": []}])
    results = run_chains(chains, cli_env)
    assert results[0][0]["returncode"] == 0, results[0][0]["stderr"][-3000:]
    reference = final_params(tmp_path / "reference")
    for point, (killed, resumed) in zip(KILLS, results[1:]):
        run_dir = tmp_path / point.replace("@", "-")
        assert killed["returncode"] == -signal.SIGKILL, f"{point}: not killed\n{killed['stderr'][-2000:]}"
        assert resumed["returncode"] == 0, f"{point}: resume failed\n{resumed['stderr'][-3000:]}"
        assert_same(reference, final_params(run_dir), point)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["compile"]["graph_breaks"] == 0


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
def test_two_compiled_ddp_ranks_match_one_eager_process(tmp_path, cli_env):
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    common = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=12",
              "loop.log_every=4", "optimizer=sgd", "optimizer.lr=0.1", "data.shuffle=true", "backend.threads=1"]
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", *common, "data.batch_size=8",
                          "backend.strategy=ddp", "backend.compile=true", f"hydra.run.dir={ddp_dir}"],
                         env=cli_env, capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "csframework", *common, "data.batch_size=16",
                             f"hydra.run.dir={single_dir}"], env=cli_env, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    summary = json.loads((ddp_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["compile"]["graph_breaks"] == 0
    a, b = final_params(ddp_dir), final_params(single_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_cli_refuses_a_graph_break_under_fullgraph_with_one_line(tmp_path, cli_env):
    done = subprocess.run([sys.executable, "-m", "csframework", "--config-dir", fixtures.CONF, "model=blobs_mlp",
                           "data=blobs", "loop.max_steps=3", "backend.compile=true", "backend.compile_fullgraph=true",
                           "model._target_=test_compiled.item_net", "~model.net", "~model.loss",
                           f"hydra.run.dir={tmp_path / 'run'}"], env=cli_env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("csframework: error:")]
    assert len(errors) == 1 and "backend.compile_fullgraph: the step does not compile into one graph" in errors[0]
    assert "test_compiled.py:" in errors[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("compiler_env", [
    {"CC": "/nonexistent/cc", "CXX": "/nonexistent/g++"},  # set to a compiler that is not there
    {"PATH": ""},  # unset, and no g++ to find (a slim container image)
], ids=["cxx-missing", "no-compiler-on-path"])
def test_without_a_cpp_compiler_the_run_trains_eagerly_with_one_warning(tmp_path, cli_env, compiler_env):
    common = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=6", "loop.log_every=3",
              "optimizer.schedule.warmup_steps=0", "backend.threads=1"]
    env = {k: v for k, v in cli_env.items() if k not in ("CC", "CXX")}
    # an empty Inductor cache: nothing compiled by an earlier run (with a compiler) is loaded instead
    env.update(compiler_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    compiled = subprocess.run([sys.executable, "-m", "csframework", *common, "backend.compile=true",
                               f"hydra.run.dir={tmp_path / 'compiled'}"], env=env, capture_output=True, text=True,
                              timeout=300)
    # before: a traceback, InvalidCxxCompiler raised by Inductor's vector-instruction check
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    warnings = [line for line in compiled.stderr.splitlines() if "[WARNING]" in line]
    assert len(warnings) == 1 and "compile_failed" in warnings[0], warnings
    assert "no working C++ compiler for Inductor: CXX" in warnings[0] and "set CXX to a C++ compiler" in warnings[0]
    assert "Traceback" not in compiled.stderr
    fallback = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compile"]["fallback"]
    assert fallback.startswith("no working C++ compiler for Inductor: CXX")
    eager = subprocess.run([sys.executable, "-m", "csframework", *common, f"hydra.run.dir={tmp_path / 'eager'}"],
                           env=cli_env, capture_output=True, text=True, timeout=300)
    assert eager.returncode == 0, eager.stderr[-3000:]
    a, b = final_params(tmp_path / "eager"), final_params(tmp_path / "compiled")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)

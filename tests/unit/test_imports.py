"""The package as a whole (``csframework/**``), and its lazily loaded public names.

The import structure: no circle among csframework's modules (function-local imports count), the tracer
is imported only when CSX is used, and the CSX low-level API is ``csf.backend`` & co., loaded on first use."""
import ast
import json
import os
import subprocess
from pathlib import Path
import sys
import warnings

import pytest

import csframework as csf
from import_graph import PACKAGE, find_cycle, imports_of, module_name


def test_no_import_circle_among_csframeworks_modules():
    files = [p for p in PACKAGE.rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_built_in_plugins_and_run_reach_fsdp_only_through_the_backend():
    # sharded checkpoints go through the Backend protocol (save_sharded, load_sharded, read_shard_metadata,
    # all_ranks_agree): a built-in or Run importing backends.fsdp ties them to one strategy again
    files = list(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    checked = [p for p in files if p.is_relative_to(PACKAGE / "builtin")] + [PACKAGE / "run.py"]
    assert any(p.parts[-2:] == ("checkpoint", "plugin.py") for p in checked)
    importers = [module_name(p) for p in checked if "csframework.backends.fsdp" in imports_of(p, modules)]
    assert importers == []


def test_importing_csframework_does_not_import_the_tracer():
    code = "import csframework, sys; assert 'csframework.graph.tracer' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


#: A run in a fresh process; prints the ``csframework.backends.csx`` modules it imported and its graph.
WITHOUT_CSX = """
import json, sys
import csframework as csf
from fixtures import compose
summary = csf.Run(compose(*sys.argv[2:]), output_dir=sys.argv[1]).fit()
print(json.dumps({"csx": sorted(m for m in sys.modules if m.startswith("csframework.backends.csx")),
                  "graph": summary.get("compile", {}).get("graph")}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("overrides, graph", [
    ((), None),
    (("backend.compile=true",), "whole step"),
    (("backend.compile=true", "backend.compile_whole_step=false"), "per function"),
])
def test_with_the_csx_plugin_disabled_no_csx_module_is_imported(tmp_path, overrides, graph):
    """The CSX emulator is a plugin like a third-party one: the CPU backend, compiled or not (its whole step
    runs on ``csframework.graph``, not on ``backends.csx``), never imports it."""
    support = Path(__file__).parents[1] / "support"
    done = subprocess.run([sys.executable, "-c", WITHOUT_CSX, str(tmp_path), "plugins.disable=[csx]",
                           "loop.max_steps=3", "backend.threads=1", *overrides],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(support)})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"csx": [], "graph": graph}


def test_the_csx_low_level_api_is_csf_backend_compile_trace_step_closure_without_a_warning():
    from csframework.backends.csx import lowlevel

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("backend", "compile", "trace", "step_closure"):
            assert getattr(csf, name) is getattr(lowlevel, name)
    assert not (PACKAGE / "csx.py").exists() and not hasattr(csf, "csx")  # the former shim module is gone


def test_the_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert csf.__version__ == version("csframework")


#: Runs ``python -m csframework`` with the arguments after ``--``, then prints the modules it imported.
MODULES_AFTER = """
import json, runpy, sys
sys.argv = ["csframework", *sys.argv[1:]]
try:
    runpy.run_module("csframework", run_name="__main__")
except SystemExit:
    pass
print("MODULES " + json.dumps(sorted(sys.modules)))
"""
HEAVY = ("torch._dynamo", "torch._inductor")


def modules_after(*argv: str, script: str = MODULES_AFTER, cwd: Path | None = None) -> set[str]:
    support = Path(__file__).parents[1] / "support"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")]),
           "CSFRAMEWORK_PLUGINS_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, cwd=cwd)
    line = next((x for x in done.stdout.splitlines() if x.startswith("MODULES ")), None)
    assert line is not None, done.stderr[-3000:]
    return set(json.loads(line.removeprefix("MODULES ")))


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["--cfg", "job"], ["device=csx", "--cfg", "job"]])
def test_help_and_cfg_import_neither_dynamo_nor_inductor(argv):
    """Issue 50 item 1: what only prints the config imports none of torch's compiler stack (seconds of imports)."""
    found = modules_after(*argv)
    assert "csframework" in found
    assert [m for m in found if m.startswith(HEAVY)] == []


#: The hand-written script of benchmarks/startup.py: the same MLP, data and optimizer, one step.
HAND = """
import json, runpy, sys
sys.argv = [sys.argv[1], "mlp"]
runpy.run_path(sys.argv[0], run_name="__main__")
print("MODULES " + json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def eager_run_modules(tmp_path_factory) -> set[str]:
    """The modules a 1-step eager run of the MLP imported (``python -m csframework``, a fresh process)."""
    out = tmp_path_factory.mktemp("eager")
    return modules_after("--config-dir", str(Path(__file__).parents[1] / "support" / "conf"), "model=blobs_mlp",
                         "data=blobs", "loop.max_steps=1", "backend.threads=1", f"hydra.run.dir={out}/run")


@pytest.mark.slow
def test_an_eager_run_imports_no_torch_module_the_plain_script_does_not(eager_run_modules):
    """Issue 50 item 1: a 1-step eager run imports no part of torch beyond what torch's own model and optimizer
    construction and step import (the hand-written script's), but for writing its checkpoint."""
    hand = modules_after(str(Path(__file__).parents[2] / "benchmarks" / "startup_hand.py"), script=HAND)
    extra = {m for m in eager_run_modules - hand if m == "torch" or m.startswith("torch.")}
    assert extra <= {"torch.utils.serialization", "torch.utils.serialization.config"}, sorted(extra)


@pytest.mark.slow
def test_an_eager_run_imports_neither_the_compile_path_nor_the_sweep(eager_run_modules):
    """Issue 50 item 1: what only ``backend.compile=true`` (the compile modules, the static-graph tracer) or a
    multirun (the sweep package: Hydra instantiates its callback for every command) uses is not imported."""
    unneeded = [m for m in eager_run_modules if m.startswith(("csframework.backends.compile.", "csframework.sweep."))
                or m in ("csframework.graph.tracer", "csframework.graph.compiler", "csframework.sweep")]
    assert unneeded == []

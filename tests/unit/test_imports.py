"""The package as a whole (``csframework/**``), and the ``csframework.csx`` shim.

The import structure: no circle among csframework's modules (function-local imports count), the tracer
is imported only when CSX is used, and the moved CSX names still work with a warning."""
import ast
import subprocess
import sys

import pytest

import csframework as csf
from import_graph import PACKAGE, find_cycle, imports_of, module_name


def test_no_import_circle_among_csframeworks_modules():
    files = [p for p in PACKAGE.rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_only_the_hydra_session_imports_hydras_private_modules():
    """Hydra's private ``hydra._internal`` may change in any release: one module holds every use of it."""
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "hydra._internal" or name.startswith("hydra._internal.") for name in names):
                users.add(module_name(path))
    assert users == {"csframework.hydra_session"}


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
    code = "import csframework, sys; assert 'csframework.backends.csx.tracer' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_the_csx_names_moved_to_csframework_csx_and_the_old_ones_warn():
    import csframework.csx as csx

    for name in ("backend", "compile", "trace", "step_closure"):
        with pytest.warns(DeprecationWarning, match=f"csframework.csx.{name}"):
            assert getattr(csf, name) is getattr(csx, name)
    assert csf.csx is csx


def test_the_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert csf.__version__ == version("csframework")

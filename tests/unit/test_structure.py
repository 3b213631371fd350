"""The house's structure (issue 42): csframework's modules sit on floors, and an import only ever goes to
the same floor or down; no circle of imports, counting those under ``if TYPE_CHECKING:`` (a type-level
circle is a circle of design all the same); no module grows past 400 lines (issue 51); Hydra is used through
its public API only, and the CLI's ``__main__`` is a page."""
import ast
from fnmatch import fnmatch

from import_graph import PACKAGE, circles, import_graph

#: The floors, from the bottom, and the modules on each (names without ``csframework.``; a pattern matches a
#: package and what is inside it when it ends in ``*``). A module may import from its own floor and below.
FLOORS = [
    ("base helpers", ["errors", "compat", "command", "jsonout", "rng", "state", "console_once", "models", "defaults",
                      "defaults.*", "files", "privatedir", "signals", "process_state", "batched", "sampling",
                      "summary_file", "collect", "rundir", "previous_runs", "mirror"]),
    ("config: schemas, composition, _target_ lookup", ["config", "config.*", "hydra_session", "targets"]),
    ("contracts: protocol, hooks, plugins", ["protocol", "hooks", "hookspecs", "plugins", "failures"]),
    ("the parts of a stage", ["precision", "schedule", "plateau", "param_groups", "data", "collate", "step", "carried",
                              "finite"]),
    ("the static-graph machinery", ["graph", "graph.*"]),
    ("backends", ["backends", "backends.*"]),
    ("loop, stage and the built-in plugins", ["loop", "evaluation", "stage", "resume", "builtin", "builtin.*", "fresh_run"]),
    ("run and the API", ["run", "api", "weights", "testing", "testset", "predict", "modes"]),
    ("sweep", ["sweep", "sweep.*", "sweep_callback", "multirun"]),
    ("the command line", ["__main__", "cli", "cli.*", "config_reference"]),
]
#: The package's ``__init__`` is the public facade (``csf.Run`` ...): it loads modules of every floor lazily,
#: and a module that reads ``__version__`` from it depends on no floor. It stands outside the floors.
FACADE = "csframework"
#: The most lines a module may have; the tracer is one algorithm that reads best whole.
MAX_LINES = 400
LONGER = {"graph/tracer.py"}
#: csframework's code and its first-party plugins', where Hydra's private modules are not used.
PLUGINS = PACKAGE.parent / "plugins"


def floor_of(module: str) -> int:
    """The index in ``FLOORS`` of ``module`` (``csframework.x.y``); a module on no floor, or on two, fails."""
    name = module.removeprefix("csframework.")
    found = [i for i, (_, patterns) in enumerate(FLOORS) if any(fnmatch(name, p) for p in patterns)]
    assert len(found) == 1, (f"{module} is on {'no floor' if not found else 'floors ' + str(found)}: place it in "
                             "FLOORS (tests/unit/test_structure.py) on the floor of what it is")
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of ``graph`` from a lower floor to a higher one."""
    return [f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
            for a in sorted(graph) if a != FACADE for b in sorted(graph[a])
            if b != FACADE and floor_of(b) > floor_of(a)]


def test_every_module_is_on_one_floor():
    for module in import_graph():
        if module != FACADE:
            floor_of(module)


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    assert upward_imports(import_graph(type_checking=True)) == []


def test_an_upward_import_is_found():
    assert upward_imports({"csframework.errors": {"csframework.run"}, "csframework.run": set()}) == [
        "csframework.errors (base helpers) -> csframework.run (run and the API)"]
    assert upward_imports({"csframework.run": {"csframework.errors"}, "csframework.errors": set()}) == []


def test_no_circle_counting_type_checking_imports():
    assert circles(import_graph(type_checking=True)) == []


def test_the_circle_finder_finds_type_level_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def module_lengths() -> dict[str, int]:
    return {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}


def over_limit(lengths: dict[str, int]) -> dict[str, int]:
    """The modules of ``lengths`` (path -> lines) longer than they may be."""
    return {path: lines for path, lines in lengths.items() if path not in LONGER and lines > MAX_LINES}


def test_no_module_is_over_400_lines():
    over = over_limit(module_lengths())
    assert over == {}, f"split these modules (at most {MAX_LINES} lines each): {over}"


def test_the_line_limit_finds_a_long_module():
    assert over_limit({"sweep/job.py": 401, "graph/tracer.py": 900, "data.py": 400}) == {"sweep/job.py": 401}


def test_the_cli_main_is_a_page():
    assert len((PACKAGE / "__main__.py").read_text().splitlines()) < 150


def private_hydra_uses(source: str) -> list[str]:
    """The uses of Hydra's private ``hydra._internal`` in ``source``: imports, and strings naming it (what
    ``importlib.import_module`` or ``__import__`` would load)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
        found += [name for name in names if name == "hydra._internal" or name.startswith("hydra._internal.")]
    return found


def test_hydra_is_used_through_its_public_api_only():
    """``hydra._internal`` may change in any Hydra release (issue 51): neither csframework nor its
    first-party plugins import it, directly or by name."""
    files = [*PACKAGE.rglob("*.py"), *PLUGINS.rglob("*.py")]
    uses = {str(p): private_hydra_uses(p.read_text()) for p in files}
    assert {path: names for path, names in uses.items() if names} == {}


def test_a_private_hydra_use_is_found():
    assert private_hydra_uses("from hydra._internal.utils import _locate") == ["hydra._internal.utils"]
    assert private_hydra_uses("import hydra._internal.hydra as h") == ["hydra._internal.hydra"]
    assert private_hydra_uses("importlib.import_module('hydra._internal.callbacks')") == ["hydra._internal.callbacks"]
    assert private_hydra_uses("from hydra import compose\nimport hydra.utils") == []


def test_run_is_under_350_lines():
    assert len((PACKAGE / "run.py").read_text().splitlines()) < 350

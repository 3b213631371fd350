"""The house's structure (issue 42): csframework's modules sit on floors, and an import only ever goes to
the same floor or down; no circle of imports, counting those under ``if TYPE_CHECKING:`` (a type-level
circle is a circle of design all the same); no module grows past 500 lines."""
from fnmatch import fnmatch

from import_graph import PACKAGE, circles, import_graph

#: The floors, from the bottom, and the modules on each (names without ``csframework.``; a pattern matches a
#: package and what is inside it when it ends in ``*``). A module may import from its own floor and below.
FLOORS = [
    ("base helpers", ["errors", "compat", "command", "jsonout", "rng", "state", "console_once", "models", "defaults",
                      "defaults.*", "files", "privatedir", "signals", "process_state", "batched", "sampling",
                      "summary_file", "collect", "rundir", "previous_runs"]),
    ("config: schemas, composition, _target_ lookup", ["config", "config.*", "hydra_session", "targets"]),
    ("contracts: protocol, hooks, plugins", ["protocol", "hooks", "hookspecs", "plugins", "failures"]),
    ("the parts of a stage", ["precision", "schedule", "plateau", "param_groups", "data", "step", "carried",
                              "finite"]),
    ("the static-graph machinery", ["graph", "graph.*"]),
    ("backends", ["backends", "backends.*"]),
    ("loop, stage and the built-in plugins", ["loop", "stage", "resume", "builtin", "builtin.*", "fresh_run"]),
    ("run and the API", ["run", "api", "weights", "testing", "testset", "predict", "modes"]),
    ("sweep", ["sweep", "sweep.*", "sweep_callback"]),
    ("the command line", ["__main__", "config_reference"]),
]
#: The package's ``__init__`` is the public facade (``csf.Run`` ...): it loads modules of every floor lazily,
#: and a module that reads ``__version__`` from it depends on no floor. It stands outside the floors.
FACADE = "csframework"
#: The most lines a module may have; the tracer is one algorithm that reads best whole.
MAX_LINES = 500
LONGER = {"graph/tracer.py"}


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


def test_no_module_is_over_500_lines():
    longer = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {path: lines for path, lines in longer.items() if lines > MAX_LINES and path not in LONGER}
    assert over == {}, f"split these modules (at most {MAX_LINES} lines each): {over}"


def test_run_is_under_350_lines():
    assert len((PACKAGE / "run.py").read_text().splitlines()) < 350

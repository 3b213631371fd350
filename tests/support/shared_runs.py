"""How the suite is spread over pytest-xdist's workers (``-n auto --dist load``, the README's test command):
test by test, so both workers stay busy to the end, except that the tests of a file that use a fixture it
defines with a class, module or package scope (runs the file makes once and its tests share) go to one
worker together, so those runs are made once. ``--dist loadfile`` sent every file whole to one worker: the
two workers then waited on each other's heaviest files. (xdist's own ``--dist loadgroup`` with groups added
at collection cannot group under pytest 9.2: pytest-xdist issue 1386.)"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

#: The fixture scopes whose value a file's tests share.
SHARED_SCOPES = {"class", "module", "package"}
WHOLE_FILE = None


def _fixture_scope(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The scope of ``@pytest.fixture(...)`` / ``@fixture`` on ``function`` ("function" if none is given), or
    ``None`` when it is no fixture."""
    for decorator in function.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "fixture":
            scopes = [k.value for k in (call.keywords if call else []) if k.arg == "scope"]
            return scopes[0].value if scopes and isinstance(scopes[0], ast.Constant) else "function"
    return None


def _arguments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {a.arg for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs}


@functools.lru_cache(maxsize=None)
def tests_sharing_a_fixture(path: Path) -> frozenset[str] | None:
    """The names of the test functions of the file at ``path`` that use (directly or through its other
    fixtures) a fixture it defines with a shared scope; ``WHOLE_FILE`` when that cannot be told by name (such
    a fixture inside a class or beside test classes, autouse, or used by ``usefixtures``; an unreadable file)."""
    try:
        text = path.read_text()
        tree = ast.parse(text, str(path))
    except (OSError, SyntaxError):
        return WHOLE_FILE
    top = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    fixtures = {f.name: f for f in top if _fixture_scope(f) is not None}
    shared = {name for name, f in fixtures.items() if _fixture_scope(f) in SHARED_SCOPES}
    nested = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and node not in top and _fixture_scope(node) in SHARED_SCOPES]
    # test classes (pytest collects ``Test*``): their tests are not named here; other classes are helpers
    classes = any(isinstance(node, ast.ClassDef) and node.name.startswith("Test") for node in tree.body)
    if nested or (shared and (classes or "autouse" in text or "usefixtures" in text)):
        return WHOLE_FILE
    grown = True
    while grown:  # a fixture that takes a shared one shares it
        more = {name for name, f in fixtures.items() if name not in shared and _arguments(f) & shared}
        shared |= more
        grown = bool(more)
    return frozenset(f.name for f in top if f.name.startswith("test") and _arguments(f) & shared)


class SharedRunsScheduling(LoadScopeScheduling):
    """xdist's scope scheduling where a scope is a file's tests that share a fixture, or a single test. Scopes
    go out largest first (xdist's default reordering): the shared runs start early and the single tests
    fill both workers to the end."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.root = Path(config.rootpath)

    def _split_scope(self, nodeid: str) -> str:
        path, _, rest = nodeid.partition("::")
        sharing = tests_sharing_a_fixture(self.root / path)
        if sharing is WHOLE_FILE or rest.split("[", 1)[0] in sharing:
            return path
        return nodeid

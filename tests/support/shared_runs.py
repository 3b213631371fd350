"""How the suite is spread over pytest-xdist's workers (``-n auto --dist load``, the README's test command):
test by test, so both workers stay busy to the end, except that the tests of a file that defines a class-,
module- or package-scoped fixture (runs the file makes once and its tests share) go to one worker together,
so those runs are made once. ``--dist loadfile`` sent every file whole to one worker: the two workers then
waited on each other's heaviest files."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

#: The fixture scopes whose value a file's tests share.
SHARED_SCOPES = {"class", "module", "package"}


def _is_shared_fixture(decorator: ast.expr) -> bool:
    """``@pytest.fixture(scope="module")`` (or class, package) as written in a test file."""
    if not isinstance(decorator, ast.Call):
        return False
    name = decorator.func.attr if isinstance(decorator.func, ast.Attribute) else getattr(decorator.func, "id", "")
    return name == "fixture" and any(k.arg == "scope" and isinstance(k.value, ast.Constant)
                                     and k.value.value in SHARED_SCOPES for k in decorator.keywords)


@functools.lru_cache(maxsize=None)
def defines_a_shared_fixture(path: Path) -> bool:
    """Whether the test file at ``path`` defines a fixture its tests share (read once, by its syntax)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):  # not a file of ours: keep it whole, as loadfile did
        return True
    return any(_is_shared_fixture(d) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               for d in node.decorator_list)


class SharedRunsScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, a scope being a whole file where its tests share a fixture and a single test
    elsewhere. Scopes go out largest first (xdist's default reordering): the shared files start early and the
    single tests fill both workers to the end."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.root = Path(config.rootpath)

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return path if defines_a_shared_fixture(self.root / path) else nodeid

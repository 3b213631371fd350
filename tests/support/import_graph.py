"""csframework's import graph as its source spells it, for the structure tests (``tests/unit/test_imports.py``,
``tests/unit/test_structure.py``): every ``import`` of a csframework module anywhere in a file (function-local
ones too), with or without those under ``if TYPE_CHECKING:``."""
from __future__ import annotations

import ast
from pathlib import Path

import csframework

PACKAGE = Path(csframework.__file__).parent


def module_name(path: Path) -> str:
    """``csframework/backends/eager.py`` -> ``csframework.backends.eager`` (a package: its ``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}


def imports_of(path: Path, modules: set[str], type_checking: bool = False) -> set[str]:
    """The csframework modules ``path`` imports anywhere in its code; those under ``if TYPE_CHECKING:``
    only with ``type_checking``. ``from pkg import name`` counts as importing ``pkg.name`` when that is a
    module, else ``pkg``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # a submodule, else a name of the module ``base``
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Every csframework module and the csframework modules it imports (``imports_of``)."""
    files = list(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules, type_checking) for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its first module repeated at the end), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every group of modules that import each other, directly or not (Tarjan's strongly connected
    components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=sorted)

"""The fenced code blocks of README.md and every page of docs/, as the recipe tests read them
(tests/e2e/test_doc_recipes.py runs them, tests/e2e/test_plugin_recipes.py installs the plugin packages
they spell out)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)


def documents() -> list[str]:
    """README.md and every page of docs/ (its subfolders included), relative to the project root."""
    return ["README.md", *sorted(page.relative_to(ROOT).as_posix() for page in (ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced code block: its document, the line its fence opens on, its language tag and its text."""

    document: str
    line: int
    language: str
    text: str

    @property
    def first(self) -> str:
        """Its first non-blank line (how the recipe tests name it)."""
        return next((line for line in self.text.splitlines() if line.strip()), "")

    def __str__(self) -> str:
        return f"{self.document}:{self.line} ({self.first.strip()[:60]})"


def blocks(document: str) -> list[Block]:
    """The fenced blocks of ``document`` (a path relative to the project root), in order."""
    text = (ROOT / document).read_text()
    return [Block(document, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in _BLOCK.finditer(text)]


def files_of(document: Path | str, package: str) -> dict[str, str]:
    """The fenced blocks of ``document`` whose first line names a file of ``package``
    (``# <package>/<path>`` or ``<!-- <package>/<path> -->``), as ``{path: text}``."""
    found = {}
    for block in blocks(str(Path(document).resolve().relative_to(ROOT))):
        named = re.fullmatch(rf"(?:#|<!--)\s*{re.escape(package)}/(\S+?)(?:\s*-->)?", block.first.strip())
        if named:
            found[named.group(1)] = block.text
    return found


def commands(block: Block) -> list[list[str]]:
    """The command lines of a shell block as argument lists, as a shell reads them: a line ending in ``\\``
    continues on the next, ``#`` starts a comment, blank lines and comments alone are skipped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def code_lines(text: str) -> list[str]:
    """``text``'s lines of Python code, comments dropped and blanks collapsed (to compare an excerpt)."""
    lines = []
    for line in text.splitlines():
        code = " ".join(re.sub(r"\s+#.*$|^\s*#.*$", "", line).split())
        if code:
            lines.append(code)
    return lines


def is_excerpt(text: str, source: str) -> bool:
    """Whether the code lines of ``text`` appear in ``source`` in the same order (other lines between
    them allowed): a documented excerpt of a file."""
    remaining = iter(code_lines(source))
    return all(any(line == other for other in remaining) for line in code_lines(text))

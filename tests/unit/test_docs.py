"""The documentation cannot drift from the code (issue 41): the config reference covers every key of every
schema (the core's sections, each backend's ``backend.*``, the installed plugins' sections) and every group
option, every key and hook has a docstring to show, and every link of README.md and docs/ leads to a page and
heading that exist. (The site's build and its look in a browser: tests/e2e/test_docs_site.py.)"""
from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
import tomllib
import typing
import unicodedata
from dataclasses import dataclass
from typing import Optional

import pytest

import csframework as csf
from csframework import config_reference, hookspecs
from csframework.config import RunConfig
from doc_blocks import ROOT, documents

CONFIG_PAGE = "docs/reference/config.md"


@pytest.fixture(scope="module")
def sources() -> config_reference.Sources:
    return config_reference.gather()


@pytest.fixture(scope="module")
def reference() -> str:
    """The generated reference as the site makes it (``markdown(gather())``), in a process of its own: in
    this one, other tests' plugins may have registered their options (a test device) with Hydra."""
    done = subprocess.run([sys.executable, "-c", "from csframework import config_reference as c; "
                           "print(c.markdown(c.gather()), end='')"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def every_key(schema: type, prefix: str) -> list[str]:
    """Every dotted key of the dataclass ``schema``, walked here independently of the generator."""
    hints = typing.get_type_hints(schema)
    keys = []
    for item in dataclasses.fields(schema):
        path = f"{prefix}.{item.name}" if prefix else item.name
        keys.append(path)
        kind = hints[item.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            keys += every_key(kind, path)
    return keys


def schemas(sources: config_reference.Sources) -> list[tuple[str, type]]:
    """Every schema the reference must cover, with the prefix of its keys."""
    hints = typing.get_type_hints(RunConfig)
    core = [(name, hints[name]) for name in (f.name for f in dataclasses.fields(RunConfig))
            if isinstance(hints[name], type) and dataclasses.is_dataclass(hints[name])]
    backends = [("backend", schema) for schema in sources.backends.values()]
    named = [("backend", schema) for _, schema in sources.named_backends.values()]
    return core + backends + named + sorted(sources.sections.items())


def rows(reference: str) -> set[str]:
    """The keys the reference has a table row for."""
    return set(re.findall(r"^\| `([^`]+)` \|", reference, re.M))


def test_every_schema_key_is_in_the_generated_reference(sources, reference):
    listed = rows(reference)
    missing = [key for prefix, schema in schemas(sources) for key in every_key(schema, prefix) if key not in listed]
    top_level = [f.name for f in dataclasses.fields(RunConfig) if f.name not in dict(schemas(sources))
                 and f.name not in config_reference.GROUPS]
    assert not missing and set(top_level) <= listed, (missing, set(top_level) - listed)


FIRST_PARTY = {"early_stopping", "mlflow", "tensorboard", "cerebras"}


def test_the_first_party_plugins_sections_are_covered(monkeypatch):
    """Every section (and named backend) of the installed first-party plugin packages, as the site's build sees
    them (every entry point loads there; this suite loads none by default). CI installs them all before it
    builds the site and runs this test again (.ci/run)."""
    monkeypatch.setenv("CSFRAMEWORK_PLUGINS_AUTOLOAD", "all")
    sources = config_reference.gather()
    installed = FIRST_PARTY & set(sources.sections)
    if not installed:
        pytest.skip("no first-party plugin package is installed")
    reference = config_reference.markdown(sources)
    for name in installed:
        assert f"### `{name}`" in reference
        assert all(key in rows(reference) for key in every_key(sources.sections[name], name))
    for name, (_, schema) in sources.named_backends.items():
        assert f"`backend={name}`" in reference and all(k in rows(reference) for k in every_key(schema, "backend"))
    assert not [f"{name}.{f.name}" for name in installed for f in dataclasses.fields(sources.sections[name])
                if not config_reference.field_docs(sources.sections[name]).get(f.name)]


def test_every_key_has_a_description(sources):
    """A key without a docstring would be an empty cell: each schema field says what it does."""
    undocumented = [f"{schema.__qualname__}.{f.name}" for _, schema in schemas(sources)
                    for cls in [schema] for f in dataclasses.fields(cls)
                    if not config_reference.field_docs(cls).get(f.name)]
    assert not undocumented, undocumented


def test_every_group_option_is_listed(reference):
    for group in config_reference.GROUPS:
        for option in (ROOT / "conf" / group).glob("*.yaml") if (ROOT / "conf" / group).is_dir() else ():
            assert f"- `{group}={option.stem}`" in reference


@dataclass
class BudgetConfig:
    max_steps: Optional[int] = None
    """Stop after this many steps."""


class BudgetPlugin:
    """A plugin of the test's own with a config section: its keys appear without anything written by hand."""

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"budget": BudgetConfig}


def test_a_new_section_appears_by_construction():
    reference = config_reference.markdown(config_reference.gather([BudgetPlugin]))
    row = next(line for line in reference.splitlines() if line.startswith("| `budget.max_steps` |"))
    assert "`int | null`" in row and "`null`" in row and "Stop after this many steps." in row


def test_an_enum_key_lists_its_allowed_values(reference):
    row = next(line for line in reference.splitlines() if line.startswith("| `optimizer.schedule.name` |"))
    assert "`constant`, `linear`, `cosine`" in row and "`constant`" in row


def test_every_hook_spec_has_a_docstring():
    specs = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(fn, f"{hookspecs.PROJECT}_spec")]
    assert {"on_fit_start", "on_train_step_end", "csframework_config_sections"} <= set(specs)
    undocumented = [name for name in specs if not (getattr(hookspecs, name).__doc__ or "").strip()]
    assert not undocumented, undocumented


# -- links ----------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$', re.M)


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's ``toc`` slugify, after the inline markup goes)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def page_text(document: str, reference: str) -> str:
    """A document as MkDocs renders it: its snippets included, the config reference generated."""
    text = (ROOT / document).read_text()
    text = text.replace("<!-- config-reference -->", reference) if document == CONFIG_PAGE else text

    def include(match: re.Match) -> str:
        source = (ROOT / match.group(1)).read_text()
        if match.group(2) is None:
            return source
        section = re.search(rf"--8<-- \[start:{match.group(2)}\].*?\n(.*?)\n.*?--8<-- \[end:{match.group(2)}\]",
                            source, re.S)
        assert section, f"{document}: no section {match.group(2)} in {match.group(1)}"
        return section.group(1)

    return _SNIPPET.sub(include, text)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (headings inside code blocks are none; a repeated one gets ``_1``)."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _FENCE.sub("", text), re.M):
        base, n = slug(heading), 1
        name = base
        while name in found:
            name, n = f"{base}_{n}", n + 1
        found.add(name)
    return found


def test_the_slug_matches_mkdocs():
    assert slug("The graph compiler (`backend.graph_compiler`)") == "the-graph-compiler-backendgraph_compiler"
    assert slug("`backend.*` of `backend=cerebras` (device type `CSX`)") == "backend-of-backendcerebras-device-type-csx"


def broken_links(document: str, text: str, reference: str) -> list[str]:
    """The links of ``text`` (the rendered ``document``) to a file that is not there, or to a heading that
    its page does not have."""
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (ROOT / document).parent / path if path else ROOT / document
        if not where.exists():
            broken.append(f"{document}: {target}: no such file")
        elif anchor and where.suffix == ".md":
            rendered = text if not path else page_text(where.resolve().relative_to(ROOT).as_posix(), reference)
            if anchor not in anchors(rendered):
                broken.append(f"{document}: {target}: no heading #{anchor} in {path or document}")
    return broken


def test_every_link_leads_to_a_page_and_heading_that_exist(reference):
    broken = [problem for document in documents()
              for problem in broken_links(document, page_text(document, reference), reference)]
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_missing_heading_or_page(reference):
    text = "## Here\n\n[a](../index.md#no-such-heading) [b](#here) [c](#gone) [d](nowhere.md) [e](sweeps.md#resuming-a-sweep)\n"
    assert broken_links("docs/guides/csx.md", text, reference) == [
        "docs/guides/csx.md: ../index.md#no-such-heading: no heading #no-such-heading in ../index.md",
        "docs/guides/csx.md: #gone: no heading #gone in docs/guides/csx.md",
        "docs/guides/csx.md: nowhere.md: no such file"]


def test_the_docs_pages_are_all_in_the_site_navigation():
    """Every page of docs/ is in mkdocs.yml's nav (MkDocs builds a page left out, but nobody finds it)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [d.removeprefix("docs/") for d in documents() if d.startswith("docs/")]
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_ci_builds_the_site_strictly_after_the_readme_test_command():
    """.ci/run keeps the README's test command as its first step, then installs the docs extra and runs the
    site's test (which skips in the core suite, without the extra), whose build is strict, and this file's
    test of the installed plugins' sections."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    steps = [line.strip() for line in lines[readme + 1:]]
    order = [next(i for i, step in enumerate(steps) if step.startswith(start)) for start in
             ('pip install -q -e ".[docs]"', "python -m pytest -q tests/e2e/test_docs_site.py "
              "tests/unit/test_docs.py::test_the_first_party_plugins_sections_are_covered")]
    assert order == sorted(order)
    site = (ROOT / "tests" / "e2e" / "test_docs_site.py").read_text()
    assert '"mkdocs", "build", "--strict"' in site and "shots.screenshots(site, browser)" in site
    assert "docs" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_reference_prints_without_the_site(reference):
    done = subprocess.run([sys.executable, "-m", "csframework.config_reference"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout == reference, done.stderr[-2000:]

"""The documentation site builds and renders (issue 41): ``mkdocs build --strict`` of mkdocs.yml succeeds, the
start page and the config reference have their title and the whole navigation, the search index holds the
generated reference, and headless Chromium renders both pages and saves their screenshots into the build
directory (docs/screenshots.py). Needs the ``docs`` extra (``pip install -e ".[docs]"``; .ci/run installs it
and runs this file after the core suite); the browser part needs Debian's ``chromium`` and skips without it."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAV = ["Getting started", "Concepts", "Guides", "Reference", "Design", "Install and first run",
       "Config reference", "Hooks", "Python API", "Architecture", "Performance figures"]

pytestmark = pytest.mark.slow


def screenshots_module():
    spec = importlib.util.spec_from_file_location("docs_screenshots", ROOT / "docs" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as CI builds it (strict: a warning fails), every installed plugin's section in its reference."""
    pytest.importorskip("mkdocs", reason='the docs extra is not installed (pip install -e ".[docs]")')
    pytest.importorskip("material", reason='the docs extra is not installed (pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, CSFRAMEWORK_PLUGINS_AUTOLOAD="all", NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def title(html: str) -> str:
    found = re.search(r"<title>(.*?)</title>", html, re.S)
    return found.group(1).strip() if found else ""


def test_the_pages_have_their_title_and_the_whole_navigation(site):
    start = (site / "index.html").read_text()
    config = (site / "reference" / "config" / "index.html").read_text()
    assert title(start) == "csframework" and title(config) == "Config reference - csframework"
    for page in (start, config):
        assert [label for label in NAV if f">{label}<" not in re.sub(r"\s*(<|>)\s*", r"\1", page)] == []


def test_the_search_index_holds_the_generated_reference(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = {doc["location"]: doc["text"] for doc in index["docs"]}
    config = " ".join(body for location, body in text.items() if location.startswith("reference/config/"))
    for key in ("optimizer.schedule.warmup_steps", "loop.max_steps", "backend.graph_compiler", "data.batched_fetch"):
        assert key in config
    assert any(location.startswith("reference/hooks/") and "on_train_step_end" in body
               for location, body in text.items())


def test_chromium_renders_the_pages_and_saves_their_screenshots(site):
    shots = screenshots_module()
    browser = shots.chromium()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
    saved = shots.screenshots(site, browser)
    assert set(saved) == {"start", "config-reference"}
    for path in saved.values():
        data = path.read_bytes()
        assert path.parent == site / "screenshots" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with shots.serve(site) as root:
        dom = shots.browse(browser, root + "reference/config/", "--dump-dom").stdout
        with urllib.request.urlopen(root + "search/search_index.json", timeout=30) as response:
            assert json.load(response)["docs"]
    assert title(dom) == "Config reference - csframework" and "md-nav" in dom and "optimizer.lr" in dom

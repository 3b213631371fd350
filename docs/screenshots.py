"""A look at the built site in a real browser: headless Chromium (Debian's ``chromium`` package) opens the start
page and the config reference, served from the build directory on 127.0.0.1, and saves their screenshots as
``<site>/screenshots/<page>.png``.

    mkdocs build --strict && python docs/screenshots.py site

Without Chromium it says so and exits 0: the screenshots are a look, not a gate (tests/e2e/test_docs_site.py
checks the pages themselves). Not part of the site (mkdocs.yml's ``exclude_docs``).
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

#: The pages looked at: screenshot name -> path under the site's root.
PAGES = {"start": "", "config-reference": "reference/config/"}
WINDOW = "1280,1600"


def chromium() -> str | None:
    """The Chromium executable, if one is installed."""
    return next(filter(None, (shutil.which(name) for name in ("chromium", "chromium-browser"))), None)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """The site served over HTTP on a free port of 127.0.0.1 (Material's search needs HTTP, not ``file://``);
    yields its root URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def browse(browser: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url`` with ``args`` (``--screenshot=...``, ``--dump-dom``), after the page's
    scripts have run (a virtual-time budget)."""
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=10000", f"--window-size={WINDOW}", *args, url],
                          capture_output=True, text=True, timeout=180, check=False)


def screenshots(site: Path, browser: str) -> dict[str, Path]:
    """The screenshot of each of ``PAGES``, saved under ``site/screenshots/``, by name."""
    out = site / "screenshots"
    out.mkdir(exist_ok=True)
    saved = {}
    with serve(site) as root:
        for name, path in PAGES.items():
            target = out / f"{name}.png"
            done = browse(browser, root + path, f"--screenshot={target}")
            if not target.exists():
                raise RuntimeError(f"chromium saved no screenshot of {root + path}: {done.stderr[-2000:]}")
            saved[name] = target
    return saved


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    browser = chromium()
    if browser is None:
        print("screenshots: no Chromium installed (Debian: apt-get install chromium); none taken")
        return 0
    for name, path in screenshots(site, browser).items():
        print(f"screenshots: {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

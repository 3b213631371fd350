"""The progress bar on a real (pseudo-)terminal: it fits the terminal's width and shows steps, ETA and loss."""
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest

from fixtures import CONF, TINY

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = re.compile(r"^\d+/\d+ ETA ")  # a frame of the bar (log lines start with a timestamp)


def run_on_terminal(columns: int, env: dict, *overrides: str) -> str:
    """Run the CLI with a pty of ``columns`` columns as stdout and stderr; returns everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "csframework", "--config-dir", CONF, *TINY, *overrides],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("no output for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_bar_fits_a_40_column_terminal_and_shows_an_eta(tmp_path, cli_env):
    env = {k: v for k, v in cli_env.items() if k not in ("COLUMNS", "LINES")}
    out = run_on_terminal(40, env, "loop.max_steps=40", "loop.log_every=5", f"hydra.run.dir={tmp_path / 'run'}")
    frames = [ANSI.sub("", part).rstrip() for line in out.split("\n") for part in line.split("\r")]
    bar = [f for f in frames if BAR.match(f)]
    assert bar, out[-2000:]
    assert all(len(f) <= 40 for f in bar), [f for f in bar if len(f) > 40]
    assert bar[-1].startswith("40/40 ETA 00:00"), bar[-1]
    assert any("loss" in f for f in bar)
    # wider terminals get the whole line: steps/s and the bar itself
    wide = run_on_terminal(100, env, "loop.max_steps=40", "loop.log_every=5", f"hydra.run.dir={tmp_path / 'wide'}")
    last = [f for line in wide.split("\n") for f in (ANSI.sub("", p).rstrip() for p in line.split("\r"))
            if BAR.match(f)][-1]
    assert re.search(r"loss [\d.]+ [\d.]+ steps/s \|\S+\|$", last) and len(last) <= 100, last

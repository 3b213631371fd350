"""Not a csframework module: the test helper ``tests/support/hostile.py``.

The hostile-directory helper (tests/support/hostile.py) can fail: it sees a victim file written through a
planted link, a file created through a dangling link, a removed or re-permissioned victim file, a hang, a
traceback, two error lines and an error line that names something else."""
from __future__ import annotations

import os
import stat
import sys

import pytest

import hostile
from hostile import Hostile, Outcome, assert_outcome, assert_sweep_outcome, strict_json


@pytest.fixture
def area(tmp_path):
    h = Hostile(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    return h, run


@pytest.mark.parametrize("kind", hostile.KINDS)
def test_every_kind_plants_what_it_says(area, kind):
    h, run = area
    path = h.plant(run / "x", kind, content=b"{}", size=1 << 20)
    st = os.lstat(path)
    expect = {"symlink-file": stat.S_ISLNK, "symlink-dir": stat.S_ISLNK, "dangling": stat.S_ISLNK,
              "hardlink": stat.S_ISREG, "fifo": stat.S_ISFIFO, "dir": stat.S_ISDIR, "file": stat.S_ISREG,
              "forged": stat.S_ISREG, "oversized": stat.S_ISREG}[kind]
    assert expect(st.st_mode)
    if kind == "hardlink":
        assert st.st_nlink == 2
    if kind == "oversized":
        assert st.st_size == 1 << 20
    if kind == "dangling":
        assert not path.exists() and str(os.readlink(path)).startswith(str(h.victim))


def test_untouched_passes_when_only_the_run_dir_changes(area):
    h, run = area
    h.plant(run / "events.jsonl", "symlink-file")
    h.guard(run)
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").write_text("own\n")  # replacing the link inside the run dir is the run's business
    (run / "new").mkdir()
    h.assert_untouched()


@pytest.mark.parametrize("attack", ["write-through-link", "write-through-hardlink", "create-through-dangling",
                                    "remove-in-linked-dir", "chmod", "create-in-cwd", "replace-with-link",
                                    "truncate-same-size"])
def test_untouched_fails_on_any_change_outside(area, attack):
    h, run = area
    h.plant(run / "f", "symlink-file")
    h.plant(run / "h", "hardlink")
    h.plant(run / "d", "dangling")
    h.plant(run / "dir", "symlink-dir")
    h.guard(run)
    victim_file = h.victim / hostile.VICTIM_FILE
    if attack == "write-through-link":
        with open(run / "f", "a") as f:
            f.write("x")
    elif attack == "write-through-hardlink":
        (run / "h").write_bytes(b"")  # truncating one name truncates the other
    elif attack == "create-through-dangling":
        (run / "d").write_text("outside")
    elif attack == "remove-in-linked-dir":
        os.unlink(run / "dir" / "123")
    elif attack == "chmod":
        os.chmod(victim_file, 0o600)
    elif attack == "create-in-cwd":
        (h.cwd / "outputs").mkdir()
    elif attack == "replace-with-link":
        victim_file.unlink()
        victim_file.symlink_to(run / "f")
    elif attack == "truncate-same-size":
        data = victim_file.read_bytes()
        victim_file.write_bytes(b"X" * len(data))
    with pytest.raises(AssertionError, match="outside the run/sweep directory"):
        h.assert_untouched()


def test_a_planted_directory_emptied_by_the_run_is_seen(area):
    h, run = area
    h.plant(run / "summary.json", "dir")
    h.guard(run)
    (run / "summary.json" / "keep.txt").unlink()
    with pytest.raises(AssertionError, match="did not create"):
        h.assert_untouched()


def test_a_hung_command_is_stopped_and_reported(area):
    h, run = area
    fifo = h.plant(run / "metrics.csv", "fifo")
    started = __import__("time").monotonic()
    out = hostile.run_command([sys.executable, "-c", f"open({str(fifo)!r}, 'a')"], dict(os.environ), h.cwd, 1.0)
    assert out.returncode is None and out.hung == "ended by SIGTERM"
    assert __import__("time").monotonic() - started < 10
    with pytest.raises(AssertionError, match="no exit within"):
        assert_outcome(out, fifo)


def _outcome(code, stderr):
    return Outcome(code, "", stderr, 1.0, "", 60.0)


def test_outcome_rules(tmp_path):
    p = tmp_path / "run" / "metrics.csv"
    ok = f"[log] fit_start\ncsframework: error: {p}: it is a FIFO or device, not a regular file; remove it\n"
    assert_outcome(_outcome(0, "whatever"), p)
    assert_outcome(_outcome(2, ok), p)
    assert_outcome(_outcome(1, ok), p)
    for code, stderr, why in [
            (2, "csframework: error: something else\n", "names none"),
            (2, ok + ok, "one 'csframework: error:' line"),
            (2, "no error line at all\n", "one 'csframework: error:' line"),
            (3, ok, "exit 0, 1 or 2"),
            (1, "Traceback (most recent call last):\n" + ok, "traceback"),
            (0, "Traceback (most recent call last):\n", "traceback")]:
        with pytest.raises(AssertionError, match=why):
            assert_outcome(_outcome(code, stderr), p)
    with pytest.raises(AssertionError, match="exit 0, 1 or 2"):
        assert_outcome(_outcome(0, ""), p, allow_success=False)
    assert_sweep_outcome(_outcome(1, f"csframework: job 0 (x=1) failed: {p} is a link\n"), p)
    with pytest.raises(AssertionError, match="no csframework line"):
        assert_sweep_outcome(_outcome(1, "csframework: job 0 (x=1) failed: boom\n"), p)


def test_strict_json_refuses_bare_constants():
    assert strict_json('{"a": null, "b": 1.5}') == {"a": None, "b": 1.5}
    for bad in ('{"a": NaN}', '{"a": Infinity}', '[-Infinity]'):
        with pytest.raises(ValueError, match="bare"):
            strict_json(bad)

"""``csframework.files``: the one atomic write, and the safe layer (``SafeDir``) through which nothing
planted in a run directory is followed, blocked on or truncated."""
import json

import pytest

from csframework.files import fsync_dir, write_json_atomic, write_text_atomic


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    write_json_atomic(path, {"step": 3, "path": tmp_path})
    assert json.loads(path.read_text()) == {"step": 3, "path": str(tmp_path)}
    write_text_atomic(path, "new", durable=False)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    fsync_dir(tmp_path)


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "index.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(path, {1j: 2})  # a complex key is not JSON
    assert path.read_text() == "old"


# -- the safe layer: nothing planted is followed, blocked on or truncated --------------------------------
import os
import stat
import threading
import time

from csframework.errors import UnsafePathError
from csframework.files import SafeDir


@pytest.fixture
def planted(tmp_path):
    """A run directory and, beside it, a victim file and directory that must stay as they are."""
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep me")
    return run, victim


def test_a_write_replaces_a_planted_link_or_hard_link_without_touching_its_target(planted):
    run, victim = planted
    (run / "summary.json").symlink_to(victim / "keep.txt")
    os.link(victim / "keep.txt", run / "events.json")
    files = SafeDir(run)
    files.write("summary.json", "{}")
    files.write("events.json", "[]")
    assert (victim / "keep.txt").read_text() == "keep me"
    assert not (run / "summary.json").is_symlink() and (run / "summary.json").read_text() == "{}"
    assert os.stat(run / "events.json").st_nlink == 1
    assert sorted(p.name for p in run.iterdir()) == ["events.json", "summary.json"]  # no temporary left


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(planted):
    run, _ = planted
    (run / "index.json").write_text("old")
    with pytest.raises(RuntimeError):
        with SafeDir(run).atomic("index.json") as f:
            f.write(b"half")
            raise RuntimeError("disk gone")
    assert (run / "index.json").read_text() == "old" and [p.name for p in run.iterdir()] == ["index.json"]


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo", "directory"])
def test_append_and_lock_refuse_anything_but_a_regular_file_of_their_own(planted, plant):
    run, victim = planted
    path = run / "metrics.csv"
    if plant == "symlink":
        path.symlink_to(victim / "keep.txt")
    elif plant == "hardlink":
        os.link(victim / "keep.txt", path)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    started = time.monotonic()
    for use in (SafeDir(run).append, SafeDir(run).lock_file):
        with pytest.raises(UnsafePathError, match=f"^{path}: "):
            use("metrics.csv")
    assert time.monotonic() - started < 5  # a FIFO is not waited on
    assert (victim / "keep.txt").read_text() == "keep me"


def test_a_fifo_with_a_reader_is_refused_too(planted):
    run, _ = planted
    os.mkfifo(run / "events.jsonl")
    reader = threading.Thread(target=lambda: open(run / "events.jsonl", "rb").close(), daemon=True)
    reader.start()
    with pytest.raises(UnsafePathError, match="not a regular file"):
        for _ in range(50):  # until the reader has it open
            try:
                SafeDir(run).append("events.jsonl")
            except UnsafePathError as e:
                if "FIFO or device" in str(e):  # no reader yet
                    time.sleep(0.02)
                    continue
                raise


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_a_directory_that_is_a_link_or_a_file_is_refused_and_nothing_is_written_through_it(planted, plant):
    run, victim = planted
    if plant == "symlink":
        (run / "checkpoints").symlink_to(victim, target_is_directory=True)
    else:
        (run / "checkpoints").write_text("x")
    why = "it is a symbolic link" if plant == "symlink" else "it is not a directory"
    with pytest.raises(UnsafePathError, match=f"^{run / 'checkpoints'}: cannot use it as a directory .{why}"):
        SafeDir(run).sub("checkpoints").write("index.json", "{}")
    with pytest.raises(UnsafePathError, match=why):
        SafeDir(run, "checkpoints").remove("keep.txt")
    with pytest.raises(UnsafePathError, match=why):  # as the root of a layer too
        SafeDir(run / "checkpoints").write("x", "y")
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]


def test_removal_unlinks_links_inside_a_tree_and_never_follows_them(planted):
    run, victim = planted
    tree = run / "step-00000002" / "sharded"
    tree.mkdir(parents=True)
    (tree / "out").symlink_to(victim, target_is_directory=True)
    (tree / "file").symlink_to(victim / "keep.txt")
    deep = run / "step-00000002"
    for i in range(300):  # deeper than a recursive walk would like
        deep = deep / "d"
    deep.mkdir(parents=True)
    SafeDir(run).remove("step-00000002")
    SafeDir(run).remove("absent")
    assert list(run.iterdir()) == [] and (victim / "keep.txt").read_text() == "keep me"


def test_reads_are_bounded_regular_files_through_no_link(planted):
    run, victim = planted
    files = SafeDir(run)
    (run / "big.json").write_bytes(b"x" * 101)
    (run / "link.json").symlink_to(victim / "keep.txt")
    os.mkfifo(run / "fifo.json")
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        files.read("big.json", 100)
    with pytest.raises(ValueError, match="symbolic link"):
        files.read("link.json", 100)
    with pytest.raises(ValueError, match="not a regular file"):
        files.read("fifo.json", 100)  # returns at once: opened without blocking
    with pytest.raises(FileNotFoundError):
        files.read("absent.json", 100)
    assert files.kind("link.json") == "link" and files.kind("fifo.json") == "other" and files.kind("x") is None


def test_a_private_directory_is_new_unpredictable_and_ours_alone(planted):
    run, _ = planted
    a, b = SafeDir(run).private_dir("collect-rank0"), SafeDir(run).private_dir("collect-rank0")
    assert a.path != b.path and a.path.name.startswith(".collect-rank0.") and len(a.path.name) == 31
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o700


def test_an_append_starts_a_line_of_its_own_after_a_line_left_unended(tmp_path):
    """A process killed mid-write leaves a last line without its newline: what is appended next must not be
    glued to it (a metrics.csv row or an events.jsonl line lost, the one before changed)."""
    (tmp_path / "events.jsonl").write_bytes(b'{"event": "a"}\n{"event": "b", "st')
    (tmp_path / "metrics.csv").write_bytes(b"step,stage,name,value\r\n")
    for name in ("events.jsonl", "metrics.csv", "new.csv"):
        with SafeDir(tmp_path).append(name) as f:
            f.write("next\n")
    assert (tmp_path / "events.jsonl").read_bytes() == b'{"event": "a"}\n{"event": "b", "st\nnext\n'
    assert (tmp_path / "metrics.csv").read_bytes() == b"step,stage,name,value\r\nnext\n"
    assert (tmp_path / "new.csv").read_bytes() == b"next\n"


def test_an_atomic_write_into_a_directory_that_refuses_new_files_names_it(tmp_path, monkeypatch):
    """A read-only or immutable run directory (the temporary file beside the target cannot be created): one
    line naming the file and the directory, not an OSError naming a temporary file's relative name."""
    import csframework.files as files_module

    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_EXCL:
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(files_module.os, "open", refusing)
    with pytest.raises(UnsafePathError, match=f"^{tmp_path / 'summary.json'}: cannot write it .*{tmp_path}"):
        SafeDir(tmp_path).write("summary.json", "{}")

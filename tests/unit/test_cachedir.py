"""Compile caches trusted like ``~/.ssh`` (issue 37): ``privatedir.PrivateDir``, ``graph.cachedir.trusted_root``
and the CSX ``CompileCache`` built on them. A cache that is not this user's alone (a directory writable by
group or others, a link, a FIFO, a hard-linked file, a file where the directory belongs) is never read: the
run compiles afresh in a private directory after one warning naming the cache and why; an entry that is a
link is never written through."""
from __future__ import annotations

import os
import threading
import warnings

import pytest

from csframework.graph import cachedir
from csframework.graph.compiler import REPORT_VERSION, CompileCache
from csframework.privatedir import PrivateDir, UntrustedDirError


@pytest.fixture(autouse=True)
def fresh_replacements(monkeypatch):
    """Each test starts with no cache replaced yet (the warning is once per cache and process)."""
    monkeypatch.setattr(cachedir, "_replacements", {})


def report(fp: str) -> str:
    return f'{{"version": {REPORT_VERSION}, "fingerprint": "{fp}", "ops": {{"total": 1}}}}'


def test_a_private_tree_is_trusted_and_each_breach_of_the_rule_is_named(tmp_path):
    cache = tmp_path / "cache"
    (cache / "entry").mkdir(parents=True)
    (cache / "entry" / "report.json").write_text("{}")
    assert PrivateDir(cache).problem() is None
    os.chmod(cache / "entry", 0o775)
    assert PrivateDir(cache).problem() == f"{cache / 'entry'}: it is writable by group or others (chmod go-w it)"
    os.chmod(cache / "entry", 0o755)
    os.link(cache / "entry" / "report.json", tmp_path / "other-name")
    assert "report.json: it has 2 names (a hard link)" in PrivateDir(cache).problem()
    os.unlink(tmp_path / "other-name")
    os.symlink(tmp_path, cache / "entry" / "graph.py")
    assert "graph.py: it is not a regular file" in PrivateDir(cache).problem()
    os.unlink(cache / "entry" / "graph.py")
    os.mkfifo(cache / "entry" / "fifo")
    assert "fifo: it is not a regular file" in PrivateDir(cache).problem()
    os.chmod(cache, 0o757)
    assert PrivateDir(cache).problem().startswith(f"{cache}: it is writable by group or others")


def test_a_shared_cache_is_replaced_by_a_private_one_with_one_warning(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # a team's project directory: anyone can plant an entry
    told: list[str] = []
    used = cachedir.trusted_root(shared, told.append)
    assert used != shared and PrivateDir(used).problem() is None
    assert cachedir.trusted_root(shared, told.append) == used  # the same replacement, no second warning
    assert told == [f"compile cache {shared} not used: {shared}: it is writable by group or others (chmod go-w it); "
                    f"this run compiles afresh in {used} (make the cache yours alone, e.g. chmod -R go-w it, or "
                    "point it at a directory of your own)"]


@pytest.mark.parametrize("kind", ["file", "fifo", "link", "below-a-file"])
def test_a_cache_root_that_is_no_directory_of_the_users_is_a_warning_not_a_traceback(tmp_path, kind):
    root = tmp_path / "cache"
    if kind == "file":
        root.write_text("notes")
    elif kind == "fifo":
        os.mkfifo(root)
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", root)
    else:
        (tmp_path / "notes.txt").write_text("notes")
        root = tmp_path / "notes.txt" / "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = cachedir.trusted_root(root)
    assert used != root and used.is_dir()
    assert [str(w.message).split(":")[0] for w in caught] == [f"compile cache {root} not used"]
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())


def test_a_read_only_cache_of_the_users_is_still_read(tmp_path):
    cache = tmp_path / "cache"
    (cache / "abc").mkdir(parents=True)
    (cache / "abc" / "report.json").write_text(report("abc"))
    os.chmod(cache, 0o555)
    try:
        assert CompileCache(cache).load("abc") == {"version": REPORT_VERSION, "fingerprint": "abc", "ops": {"total": 1}}
    finally:
        os.chmod(cache, 0o755)


def test_an_entry_that_is_a_link_is_neither_read_nor_written_through(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (outside / "report.json").write_text(report("abc"))
    compile_cache = CompileCache(cache)
    os.symlink(outside, cache / "abc")  # planted after the cache was found private
    assert compile_cache.load("abc") is None
    entry_report: dict = {}
    compile_cache.store("abc", entry_report, "def f(): pass\n")
    assert sorted(os.listdir(outside)) == ["report.json"]  # no graph.py, report.json untouched
    assert (outside / "report.json").read_text() == report("abc")
    assert "compile cache not written" in entry_report["warnings"][0]


def test_a_fifo_or_a_hard_link_at_the_report_is_a_miss_without_blocking(tmp_path):
    cache = tmp_path / "cache"
    (cache / "fifo").mkdir(parents=True)
    (cache / "linked").mkdir()
    compile_cache = CompileCache(cache)
    os.mkfifo(cache / "fifo" / "report.json")
    (tmp_path / "forged.json").write_text(report("linked"))
    os.link(tmp_path / "forged.json", cache / "linked" / "report.json")
    result: list = []
    reader = threading.Thread(target=lambda: result.append((compile_cache.load("fifo"), compile_cache.load("linked"))),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert result == [(None, None)]


@pytest.mark.parametrize("text", ['[1, 2]', '"report"', '{"version": 1}', '{"version": 1, "fingerprint": 7}',
                                  '{"version": 1, "fingerprint": "abc"}',
                                  '{"version": 1, "fingerprint": "abc", "ops": {"total": "many"}}',
                                  '{"version": 1, "fingerprint": "abc", "ops": {"total": 3}, "memory": {"x": "y"}}'])
def test_a_report_of_the_wrong_shape_is_a_miss(tmp_path, text):
    cache = tmp_path / "cache"
    (cache / "abc").mkdir(parents=True)
    (cache / "abc" / "report.json").write_text(text)
    assert CompileCache(cache).load("abc") is None


def test_a_directory_of_another_owner_is_refused(tmp_path, monkeypatch):
    """Files of another user cannot be made without root: pretend this process is another user."""
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(UntrustedDirError, match=f"{tmp_path / 'cache'}: it is owned by uid {os.getuid()}"):
        PrivateDir(tmp_path / "cache").sub(create=False)


def test_a_cache_this_process_cannot_write_is_replaced_for_inductor_only(tmp_path):
    """A cache of the user's own made read-only (``chmod 500``; for root, whom permission bits do not stop,
    also ``chattr +i``, which the kernel enforces on root too): Inductor's (``writable=True``) is replaced by a
    private one with one warning naming it and why; the CSX cache (read, never required to be written) stays."""
    import shutil
    import subprocess

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o500)
    if os.geteuid() == 0 and (shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(cache)], capture_output=True).returncode != 0):
        pytest.skip("running as root, and chattr +i (which root's writes obey) is not available here")
    try:
        assert cachedir.trusted_root(cache) == cache  # read-only is fine where nothing must be written
        told: list[str] = []
        used = cachedir.trusted_root(cache, told.append, writable=True)
        assert used != cache and PrivateDir(used).problem() is None
        assert len(told) == 1 and told[0].startswith(f"compile cache {cache} not used: {cache}: it is not writable (")
        assert told[0].endswith("(chmod u+w it, or point it at a directory you can write)")
        assert list(cache.iterdir()) == []  # the probe left nothing
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(cache)], capture_output=True)
        os.chmod(cache, 0o700)


def test_a_file_anyone_can_write_in_a_private_tree_breaks_the_rule(tmp_path):
    """Issue 47 (1): the user's own 0755 directories holding an entry of mode 0666 (unpacked from an archive,
    written under a loose umask): another user can rewrite it, so the cache is not used, naming the file and
    the fix; and a file made so after the walk is not read either."""
    cache = tmp_path / "cache"
    (cache / "steps-default" / "abc").mkdir(parents=True)
    artifact = cache / "steps-default" / "abc" / "inductor-x.bin"
    artifact.write_bytes(b"artifact")
    os.chmod(artifact, 0o666)
    told: list[str] = []
    used = cachedir.trusted_root(cache, told.append)
    assert used != cache
    assert told == [f"compile cache {cache} not used: {artifact}: it is writable by group or others (chmod go-w it); "
                    f"this run compiles afresh in {used} (make the cache yours alone, e.g. chmod -R go-w it, or "
                    "point it at a directory of your own)"]
    other = tmp_path / "other"
    (other / "abc").mkdir(parents=True)
    (other / "abc" / "report.json").write_text(report("abc"))
    compile_cache = CompileCache(other)
    assert compile_cache.load("abc") is not None
    os.chmod(other / "abc" / "report.json", 0o646)  # loosened after the cache was found private
    assert compile_cache.load("abc") is None


def test_the_walk_of_a_wide_cache_holds_few_descriptors(tmp_path):
    """Issue 47 (13): a cache of 1200 directories walked under a descriptor limit 40 above what this process
    holds: the user's own cache is still trusted (before: every sibling directory was held open, the walk ran
    out of descriptors, and the cache was called untrusted)."""
    import resource

    cache = tmp_path / "cache"
    for i in range(1200):
        (cache / f"{i:02x}"[:2] / f"entry-{i}").mkdir(parents=True, exist_ok=True)
        (cache / f"{i:02x}"[:2] / f"entry-{i}" / "report.json").write_text("{}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
    try:
        problem = PrivateDir(cache).problem()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert problem is None


def test_a_tree_deeper_than_the_bound_is_refused(tmp_path):
    cache = tmp_path / "cache"
    deep = cache.joinpath(*["d"] * 40)
    deep.mkdir(parents=True)
    assert PrivateDir(cache).problem() == (f"{cache.joinpath(*['d'] * 33)}: it is more than 32 directories below "
                                           f"{cache}; clear it")
    assert PrivateDir(cache).problem(max_depth=40) is None

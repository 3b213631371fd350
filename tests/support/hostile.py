"""Hostile run and sweep directories (issue 27): plant what an attacker with write access to a run or sweep
directory could, run csframework over it, and check that nothing outside was touched and that the run
either succeeded or ended with one line naming what was planted, in bounded time.

- :class:`Hostile` owns a scratch area: a *victim* tree beside the directories under attack (files with
  known bytes, a directory with files named like pids), ``plant(path, kind)`` (a link to a victim file or
  directory, a dangling link into the victim tree, a hard link to a victim file, a FIFO, a directory where a
  file belongs, a file where a directory belongs, forged bytes, a sparse oversized file), ``guard(owned...)``
  then ``assert_untouched()`` (everything in the scratch area outside the owned run/sweep directories is
  byte-identical: paths, types, permissions, bytes, link targets; nothing created or removed), and
  ``cli(args)``: ``python -m csframework`` in its own session with a hard timeout (a hung run is stopped
  with SIGTERM, then SIGKILL, and reported as hung).
- :func:`forge_state`: a checkpoint's state rewritten with consistent checksums (a forged value, not damage).
- :func:`assert_outcome`: exit 0, or exit 1/2 with one ``csframework: error:`` line naming the planted path;
  never a traceback, never a hang.
- Plugins for CLI runs (``plugins.enable=[hostile:Planter]`` etc.; tests/support is on ``PYTHONPATH``):
  ``Planter`` plants names the framework would use with its own pid (predictable temporary names) from
  inside the run, ``BigSection`` declares a config section whose default exceeds the 16 MiB config read
  limit, ``OddMetrics`` reports NaN/infinite metrics and a metric name carrying control characters.

This module imports only the standard library at load time (plus csframework for the plugins' hooks).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import csframework as csf

#: The victim tree: relative path -> bytes. ``dir/`` is what directory links point at; the names inside it
#: are those a run or sweep writes or removes (pids as in ``.jobs``, ``index.json``, ``summary.json``).
VICTIM_FILES = {
    "file.txt": b"the victim's file: must stay byte-identical\n",
    "dir/a.txt": b"victim a\n",
    "dir/b.bin": bytes(range(256)) * 16,
    "dir/123": b"",
    "dir/99999": b"pid-like\n",
    "dir/index.json": b'{"checkpoints": []}\n',
    "dir/summary.json": b'{"status": "completed"}\n',
    "dir/sub/c.txt": b"victim c\n",
}
VICTIM_FILE = "file.txt"
VICTIM_DIR = "dir"

#: What ``plant`` can put at a path.
KINDS = ("symlink-file", "symlink-dir", "dangling", "hardlink", "fifo", "dir", "file", "forged", "oversized")

#: Seconds a single tiny run, and a two-job multirun, may take before it counts as hung (they take a few
#: seconds; the margin is for a machine shared with other work; the environment may shorten or lengthen it).
RUN_TIMEOUT = float(os.environ.get("CSF_HOSTILE_RUN_TIMEOUT", 90))
SWEEP_TIMEOUT = float(os.environ.get("CSF_HOSTILE_SWEEP_TIMEOUT", 180))


class Entry(NamedTuple):
    kind: str  # file, dir, symlink, fifo, socket, other
    mode: int
    content: str | None  # sha256 of a file's bytes, a link's target


def _entry(path: str) -> Entry:
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return Entry("symlink", 0, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return Entry("dir", mode, None)
    if stat.S_ISREG(st.st_mode):
        digest = hashlib.sha256()
        # O_NOFOLLOW|O_NONBLOCK: the entry was a regular file a moment ago; never block on a swapped-in FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return Entry("file", mode, f"{st.st_size}:{digest.hexdigest()}")
    if stat.S_ISFIFO(st.st_mode):
        return Entry("fifo", mode, None)
    if stat.S_ISSOCK(st.st_mode):
        return Entry("socket", mode, None)
    return Entry("other", mode, None)


def snapshot(root: Path, exclude: Iterable[Path] = ()) -> dict[str, Entry]:
    """Every entry under ``root`` (relative path -> type, permissions, bytes' digest or link target), links
    not followed, FIFOs not opened; ``exclude``: paths (and what is under them) left out."""
    root = Path(root)
    skip = {os.path.normpath(str(p)) for p in exclude}
    out: dict[str, Entry] = {}

    def walk(directory: str) -> None:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            full = os.path.normpath(e.path)
            if full in skip:
                continue
            entry = _entry(full)
            out[os.path.relpath(full, root)] = entry
            if entry.kind == "dir":
                walk(full)

    walk(str(root))
    return out


def diff(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    """What changed between two snapshots, one line each (empty: nothing)."""
    lines = [f"created: {p} ({after[p].kind})" for p in sorted(after.keys() - before.keys())]
    lines += [f"removed: {p} ({before[p].kind})" for p in sorted(before.keys() - after.keys())]
    lines += [f"changed: {p}: {before[p]} -> {after[p]}" for p in sorted(before.keys() & after.keys())
              if before[p] != after[p]]
    return lines


def make_victim(victim: Path) -> None:
    for rel, data in VICTIM_FILES.items():
        path = victim / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def plant(path: Path, kind: str, victim: Path, *, content: bytes = b"", size: int = 300 << 20,
          target: Path | None = None) -> Path:
    """Put ``kind`` at ``path`` (its parent directories are created as real directories):

    - ``symlink-file`` / ``symlink-dir``: a link to the victim's file / directory;
    - ``dangling``: a link to a name in the victim tree that does not exist (writing through it creates a
      file outside);
    - ``hardlink``: a second name of the victim's file;
    - ``fifo``: a named pipe nobody writes to or reads from (opening it blocks);
    - ``dir``: a directory (holding ``keep.txt``) where a file belongs;
    - ``file``: a regular file where a directory belongs;
    - ``forged``: a regular file holding ``content``;
    - ``oversized``: ``content`` then a hole up to ``size`` bytes (sparse: costs no disk).

    ``target``: what a link (``symlink-*``, ``hardlink``) points at instead of the victim's file or
    directory (another run's files). Whatever was at ``path`` is removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "symlink-file":
        path.symlink_to(target or victim / VICTIM_FILE)
    elif kind == "symlink-dir":
        path.symlink_to(target or victim / VICTIM_DIR, target_is_directory=True)
    elif kind == "dangling":
        path.symlink_to(victim / f"created-through-{path.name.lstrip('.')}")
    elif kind == "hardlink":
        os.link(target or victim / VICTIM_FILE, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "keep.txt").write_bytes(b"planted directory's own file\n")
    elif kind == "file":
        path.write_bytes(b"a file where a directory belongs\n")
    elif kind == "forged":
        path.write_bytes(content)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.write(content)
            f.truncate(size)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    return path


def deep_json(levels: int = 100_000) -> bytes:
    """A JSON document nested ``levels`` deep (Python's parser recurses: RecursionError)."""
    return b"[" * levels + b"]" * levels


def forge_state(checkpoint: Path, change, meta_step: int | None = None) -> None:
    """Rewrite ``checkpoint``'s ``state.pt`` with ``change(state)`` applied, and its meta.json's sizes and
    checksums to match (a forger can compute them too: they prove consistency, not authorship);
    ``meta_step`` also plants a ``global_step`` in meta.json (version 1's meta held one; nothing reads it now)."""
    import torch

    from csframework.builtin.checkpoint.format import file_crc32

    state = torch.load(checkpoint / "state.pt", weights_only=True)
    change(state)
    torch.save(state, checkpoint / "state.pt")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["state.pt"] = {"bytes": (checkpoint / "state.pt").stat().st_size,
                                 "crc32": file_crc32(checkpoint / "state.pt")}
    if meta_step is not None:
        meta["global_step"] = meta_step
    (checkpoint / "meta.json").write_text(json.dumps(meta))


class Outcome(NamedTuple):
    returncode: int | None  # None: hung (stopped by the test)
    stdout: str
    stderr: str
    seconds: float
    hung: str  # "" or how the hang ended ("ended by SIGTERM", "needed SIGKILL")
    timeout: float

    def __str__(self) -> str:
        return (f"exit {self.returncode} after {self.seconds:.1f} s{' HUNG ' + self.hung if self.hung else ''}\n"
                f"--- stderr (tail) ---\n{self.stderr[-3000:]}\n--- stdout (tail) ---\n{self.stdout[-1000:]}")


def run_command(command: Sequence[str], env: dict, cwd: Path, timeout: float) -> Outcome:
    """``command`` in a session of its own; not done within ``timeout`` s: SIGTERM to its process group,
    then (10 s later) SIGKILL, and the outcome says it hung."""
    start = time.monotonic()
    proc = subprocess.Popen(list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    hung = ""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
            hung = "ended by SIGTERM"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            hung = "SIGTERM did not end it; needed SIGKILL"
    finally:
        # nothing of the run may outlive it (loader workers, launcher workers)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return Outcome(None if hung else proc.returncode, out, err, time.monotonic() - start, hung, timeout)


# -- a fork server: the CLI's command line in a fresh forked process, without the interpreter's start-up -------
#: Set to 1 to run every command as a real ``python -m csframework`` subprocess instead (slower: each pays
#: the interpreter's and torch's start-up, several seconds on a loaded machine).
SPAWN_ENV = "CSF_HOSTILE_SPAWN"


def _serve() -> None:
    """The server: import csframework (and torch, Hydra) once, then for each request line on stdin fork a
    child in a session of its own that runs the CLI's ``main()`` with the request's argv, environment and
    working directory (stdin from /dev/null, stdout/stderr to the request's files), wait for it with the
    request's timeout (SIGTERM to its process group, 10 s later SIGKILL), and answer one line."""
    from forkrun import preload

    preload()  # once, before forking (no thread pool started yet)

    for line in sys.stdin:
        req = json.loads(line)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(req)
        code, hung = _wait(pid, req["timeout"])
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever the run left in its session
        except (ProcessLookupError, PermissionError):
            pass
        sys.stdout.write(json.dumps({"returncode": code, "hung": hung, "seconds": time.monotonic() - start}) + "\n")
        sys.stdout.flush()


def _child(req: dict) -> None:
    from forkrun import run_cli_and_exit

    def setup():
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT)):
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)

    run_cli_and_exit(req["argv"], setup)


def _wait(pid: int, timeout: float) -> tuple[int | None, str]:
    def wait_until(deadline: float) -> int | None:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        return None

    code = wait_until(time.monotonic() + timeout)
    if code is not None:
        return code, ""
    os.killpg(pid, signal.SIGTERM)
    if wait_until(time.monotonic() + 10) is not None:
        return None, "ended by SIGTERM"
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None, "SIGTERM did not end it; needed SIGKILL"


class ForkServer:
    """The client of :func:`_serve` (one per test process, started on first use)."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, argv: Sequence[str], env: dict, cwd: Path, timeout: float) -> Outcome:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="hostile-out-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "cwd": str(cwd), "stdout": out,
                                              "stderr": err, "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"the hostile fork server died (exit {self.proc.wait()})")
            result = json.loads(answer)
            read = lambda p: Path(p).read_text(errors="replace") if os.path.exists(p) else ""  # noqa: E731
            return Outcome(result["returncode"], read(out), read(err), result["seconds"], result["hung"], timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_SERVERS: dict[str, ForkServer] = {}


def cli(args: Sequence[str], env: dict, cwd: Path, timeout: float) -> Outcome:
    """``python -m csframework args`` (a child forked from a server that imported csframework once, started
    with ``env``'s ``PYTHONPATH``; with ``$CSF_HOSTILE_SPAWN=1`` a real subprocess)."""
    if os.environ.get(SPAWN_ENV) == "1":
        return run_command([sys.executable, "-m", "csframework", *args], env, cwd, timeout)
    key = env.get("PYTHONPATH", "")
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        import atexit

        _SERVERS[key] = ForkServer(env)
        atexit.register(_SERVERS[key].close)
    return _SERVERS[key].run(args, env, cwd, timeout)


class Hostile:
    """A scratch area ``root`` with a victim tree (``root/victim``) beside the run or sweep directories
    under attack, which ``guard`` names as owned: everything else in ``root`` must stay as it was."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.victim = self.root / "victim"
        self.cwd = self.root / "cwd"  # the runs' working directory: nothing may appear there either
        make_victim(self.victim)
        self.cwd.mkdir(exist_ok=True)
        self.owned: list[Path] = []
        self.before: dict[str, Entry] | None = None
        self.planted: list[tuple[Path, str]] = []

    def plant(self, path: Path, kind: str, **kwargs) -> Path:
        self.planted.append((Path(path), kind))
        return plant(path, kind, self.victim, **kwargs)

    def guard(self, *owned: Path) -> None:
        """Snapshot everything in the scratch area except ``owned`` (the directories under attack)."""
        self.owned = [Path(p) for p in owned]
        self.before = snapshot(self.root, self.owned)

    def assert_untouched(self) -> None:
        """Nothing outside the owned directories was created, removed or changed (victim files, other runs,
        the working directory); a directory planted inside them still holds its own file."""
        assert self.before is not None, "guard() first"
        changes = diff(self.before, snapshot(self.root, self.owned))
        assert not changes, "outside the run/sweep directory:\n  " + "\n  ".join(changes)
        for path, kind in self.planted:
            if kind == "dir" and os.path.lexists(path) and not path.is_symlink() and path.is_dir():
                keep = path / "keep.txt"
                assert keep.is_file() and keep.read_bytes() == b"planted directory's own file\n", \
                    f"the framework deleted or rewrote a file it did not create: {keep}"

    def cli(self, args: Sequence[str], env: dict, timeout: float = RUN_TIMEOUT) -> Outcome:
        """``python -m csframework args`` from ``root/cwd`` with a hard timeout (see :func:`cli`)."""
        return cli(args, env, self.cwd, timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("csframework: error:")]


def assert_bounded(out: Outcome) -> None:
    assert not out.hung, f"no exit within {out.timeout:.0f} s ({out.hung}):\n{out}"
    assert "Traceback (most recent call last)" not in out.stderr + out.stdout, f"a traceback:\n{out}"


def assert_outcome(out: Outcome, *planted: Path, allow_success: bool = True) -> None:
    """The run ended in bounded time without a traceback, and either succeeded (``allow_success``) or
    exited 1 or 2 with exactly one ``csframework: error:`` line naming one of ``planted``."""
    assert_bounded(out)
    if out.returncode == 0 and allow_success:
        return
    assert out.returncode in (1, 2), f"expected exit 0, 1 or 2:\n{out}"
    lines = error_lines(out.stderr)
    assert len(lines) == 1, f"expected one 'csframework: error:' line, got {len(lines)}:\n{out}"
    assert any(str(p) in lines[0] for p in planted), \
        f"the error line names none of {[str(p) for p in planted]}:\n{out}"


def assert_sweep_outcome(out: Outcome, *planted: Path) -> None:
    """A multirun over a planted path: bounded, no traceback, and exit 0, or exit 1/2 with a
    ``csframework:`` line naming one of ``planted`` (a job's failure is reported in its own line, then in
    the closing list of failed jobs, so more than one line may name it)."""
    assert_bounded(out)
    if out.returncode == 0:
        return
    assert out.returncode in (1, 2), f"expected exit 0, 1 or 2:\n{out}"
    naming = [line for line in out.stderr.splitlines()
              if line.lstrip().startswith(("csframework:", "- job")) and any(str(p) in line for p in planted)]
    assert naming, f"no csframework line names any of {[str(p) for p in planted]}:\n{out}"


def strict_json(text: str):
    """``json.loads`` that refuses the non-standard constants (``NaN``, ``Infinity``, ``-Infinity``)."""
    def refuse(name):
        raise ValueError(f"not JSON: bare {name}")

    return json.loads(text, parse_constant=refuse)


# -- plugins for CLI runs ------------------------------------------------------------------------------------
PLANT_ENV = "CSF_HOSTILE_PLANT"


class Planter:
    """Plants, from inside the run at ``on_fit_start`` (first), what ``$CSF_HOSTILE_PLANT`` lists:
    ``{"victim": dir, "plants": [{"path": "<relative to the run dir, {pid} is this process>", "kind":
    ...}]}``: the names a framework would derive from its pid are predictable to anyone who sees it run."""

    name = "hostile_planter"

    @csf.hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        spec = json.loads(os.environ.get(PLANT_ENV, "{}") or "{}")
        for item in spec.get("plants", []):
            path = Path(run.output_dir) / item["path"].format(pid=os.getpid())
            if not os.path.lexists(path):
                plant(path, item["kind"], Path(spec["victim"]))


def planter_env(victim: Path, *plants: tuple[str, str]) -> dict[str, str]:
    return {PLANT_ENV: json.dumps({"victim": str(victim), "plants": [{"path": p, "kind": k} for p, k in plants]})}


#: The config reader's limit (docs/durability.md: config.yaml is at most 16 MiB), and a default above it.
CONFIG_LIMIT = 16 << 20


@dataclasses.dataclass
class BigSectionConfig:
    blob: str = "x" * (CONFIG_LIMIT + (1 << 20))
    """A default of 17 MiB: every config this plugin is part of exceeds the config read limit."""


class BigSection:
    """Declares config section ``bigsection`` whose default is bigger than a checkpoint's config may be."""

    name = "bigsection"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"bigsection": BigSectionConfig}


#: A metric name that would forge a console line and recolour the terminal if printed raw.
EVIL_NAME = "evil\x1b[31m\r\ncsframework: error: FORGED LINE\x07"


class OddMetrics:
    """Reports NaN and infinite metrics and a metric whose name carries control characters, every step."""

    name = "odd_metrics"

    @csf.hookimpl
    def on_train_batch_end(self, run):
        run.report({"odd/nan": float("nan"), "odd/inf": float("inf"), "odd/ninf": float("-inf"),
                    EVIL_NAME: 1.0})


class OddSummary:
    """Puts values JSON cannot hold into ``summary.json`` (``run.summary_extra``): a NaN, an infinity and an
    object whose repr is not data."""

    name = "odd_summary"

    @csf.hookimpl
    def on_train_batch_end(self, run):
        run.summary_extra["odd_extra"] = {"nan": float("nan"), "inf": float("inf"), "obj": object()}


@dataclasses.dataclass
class NoteConfig:
    text: str = ""
    """Free text, swept to put arbitrary strings (spreadsheet formulas) into ``sweep.csv``."""


#: A metric name a spreadsheet would evaluate (it becomes a ``sweep.csv`` column header).
FORMULA_METRIC = "=1+2"


class Note:
    """Declares config section ``note`` (``note.text``: any string) and reports a metric named like a
    formula (``FORMULA_METRIC``)."""

    name = "note"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"note": NoteConfig}

    @csf.hookimpl
    def on_train_batch_end(self, run):
        run.report({FORMULA_METRIC: 1.0})


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()

"""Hostile compile caches (issue 37): what a compile cache holds is executed (Inductor imports the Python
modules it generated, the whole step's artifacts are pickles), so a cache that others can write is never read.

A real compile fills a cache (``backend.compile=true``: the whole step's artifacts and Inductor's modules of the
per-function evaluation; ``device=csx backend.graph_compiler=inductor``: ``backend.compile_dir``); then every
generated module gets a payload that creates a marker file, and the cache is made group-writable, as a team's
shared directory is. A later run must write no marker, give one warning naming the cache and why, compile
afresh and complete. Also: float32 and cbfloat16 compiled into one cache, one after the other and both at once,
each end with their own losses. Inductor compiles take a minute here: every test is ``slow``.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from csframework.graph import inductor
from fixtures import CONF

pytestmark = [pytest.mark.slow,
              pytest.mark.requires_torch(inductor.STANDALONE_TORCH, "torch._inductor.standalone_compile")]

TINY = ["--config-dir", CONF, "model=blobs_mlp", "data=blobs", "loop.max_steps=3", "loop.eval_every=null",
        "loop.eval_steps=null", "loop.log_every=1", "optimizer=sgd", "optimizer.lr=0.1"]
WHOLE_STEP = [*TINY, "backend.compile=true"]
CSX = [*TINY, "device=csx", "backend.graph_compiler=inductor"]


def cli(cli_env, cwd: Path, args: list[str], run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "csframework", *args, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env={**cli_env, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def filled(tmp_path_factory, cli_env_module):
    """``inductor/`` (``$TORCHINDUCTOR_CACHE_DIR`` of a ``backend.compile=true`` run) and ``csx/`` (the
    ``compile_dir`` of a compiled CSX run), each filled by a real compile."""
    base = tmp_path_factory.mktemp("caches")
    cli(cli_env_module, base, WHOLE_STEP, base / "run-whole", TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"))
    cli(cli_env_module, base, [*CSX, f"backend.compile_dir={base / 'csx'}"], base / "run-csx")
    return base


def plant_payloads(cache: Path, marker: Path) -> int:
    """Append code that creates ``marker`` to every module in ``cache``; returns how many."""
    modules = sorted(cache.rglob("*.py"))
    for module in modules:
        with open(module, "a") as f:
            f.write(f"\nopen({str(marker)!r}, 'a').write({module.name!r} + '\\n')\n")
    return len(modules)


def share(cache: Path) -> None:
    """Make ``cache`` a team's shared directory: writable by its group."""
    os.chmod(cache, 0o775)


@pytest.fixture
def read_only():
    """``read_only(path)``: make the tree at ``path`` one its owner cannot write: ``chmod -R a-w``, and for root
    (whom permission bits do not stop) also ``chattr -R +i`` (immutable: the kernel refuses every write, root's
    too); skips where ``chattr`` cannot. Undone afterwards, so the test's directory can be removed."""
    made: list[Path] = []

    def make(path: Path) -> None:
        for p in [path, *path.rglob("*")]:
            os.chmod(p, os.stat(p).st_mode & ~0o222)
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "-R", "+i", str(path)],
                                                                capture_output=True).returncode != 0:
                pytest.skip("running as root, and chattr +i (which root's writes obey) is not available here")
            with pytest.raises(PermissionError):
                (path / "probe").write_text("")
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        for p in [path, *path.rglob("*")]:
            os.chmod(p, os.stat(p).st_mode | 0o200)


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if "compile_cache_untrusted" in line]


@pytest.mark.parametrize("which", ["inductor", "csx"])
def test_a_planted_module_in_a_shared_cache_never_runs(filled, tmp_path, cli_env, which):
    cache = tmp_path / which
    shutil.copytree(filled / which, cache)
    marker = tmp_path / "payload-ran"
    assert plant_payloads(cache, marker) >= 1
    share(cache)
    if which == "inductor":
        result = cli(cli_env, tmp_path, WHOLE_STEP, tmp_path / "run", TORCHINDUCTOR_CACHE_DIR=str(cache))
    else:
        result = cli(cli_env, tmp_path, [*CSX, f"backend.compile_dir={cache}"], tmp_path / "run")
    assert not marker.exists(), f"the planted code ran: {marker.read_text()}"
    told = warnings_of(result)
    assert len(told) == 1 and f"compile cache {cache} not used: {cache}: it is writable by group or others" in told[0]
    assert '"status": "completed"' in (tmp_path / "run" / "summary.json").read_text()


def payload(marker: Path) -> bytes:
    """A pickle that appends to ``marker`` when it is loaded."""
    class Payload:
        def __reduce__(self):  # unpickling it calls exec(...)
            return exec, (f"open({str(marker)!r}, 'a').write('payload ran\\n')",)

    return pickle.dumps(Payload())


def plant_artifact_payload(artifact: Path, planted: bytes) -> None:
    """Rewrite the whole step's artifact ``artifact`` as another user would: its AOT autograd entry (a pickle,
    which loading the artifact unpickles) replaced by ``planted``."""
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer, BytesReader, BytesWriter

    reader = BytesReader(artifact.read_bytes())
    header, torch_key, key, entries = reader.read_bytes(), reader.read_bytes(), reader.read_str(), reader.read_bytes()
    CacheArtifactManager._ensure_cache_artifacts_registered()
    groups = AppendingByteSerializer.to_list(entries, deserialize_fn=_deserialize_single_cache)
    assert "aot_autograd" in dict(groups), [kind for kind, _ in groups]
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([(kind, [type(a)(a.key, planted if kind == "aot_autograd" else a.content) for a in found])
                       for kind, found in groups])
    writer = BytesWriter()
    writer.write_bytes(header)
    writer.write_bytes(torch_key)
    writer.write_str(key)
    writer.write_bytes(serializer.to_bytes())
    artifact.write_bytes(writer.to_bytes())


def test_a_planted_artifact_anyone_can_write_in_the_users_own_cache_never_runs(filled, tmp_path, cli_env):
    """Issue 47 (1): the cache's directories are the user's own 0755 ones, but its files are mode 0666 (unpacked
    from an archive, written under a loose umask), and another user rewrote the whole step's artifact (and
    Inductor's own copy of its AOT entry, which loading the artifact would otherwise find first) to run code.
    The next run writes no marker, gives one warning naming a file and the fix, compiles afresh and completes
    (before: the rule checked a file's owner, type and links, not its mode; the payload ran, exit 0). The
    payload is first shown to run when the artifact is loaded through csframework's reader at mode 0644."""
    cache = tmp_path / "inductor"
    shutil.copytree(filled / "inductor", cache)
    (artifact,) = cache.glob("steps-default/*/inductor-*.bin")
    marker = tmp_path / "payload-ran"
    planted = payload(marker)
    plant_artifact_payload(artifact, planted)
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    shutil.copy(artifact, control / artifact.name)
    subprocess.run([sys.executable, "-c", "import sys; from csframework.graph import inductor; "
                    "from csframework.privatedir import PrivateDir\n"
                    "try: inductor._load_artifact(PrivateDir(sys.argv[1]), sys.argv[2])\nexcept Exception: pass",
                    str(control), artifact.name], env={**cli_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")},
                   capture_output=True, timeout=600)
    assert marker.exists(), "the planted payload does not run even at mode 0644: the test proves nothing"
    marker.unlink()
    local = list(cache.glob("steps-default/inductor/aotautograd/*/*"))
    assert local, "Inductor's cache holds no AOT entry of the whole step"
    for entry in local:
        entry.write_bytes(planted)
    for path in cache.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666)
    result = cli(cli_env, tmp_path, WHOLE_STEP, tmp_path / "run", TORCHINDUCTOR_CACHE_DIR=str(cache))
    assert not marker.exists(), f"the planted code ran: {marker.read_text()}"
    told = warnings_of(result)
    assert len(told) == 1 and re.search(rf"compile cache {re.escape(str(cache))} not used: {re.escape(str(cache))}/"
                                        r"\S+: it is writable by group or others \(chmod go-w it\)", told[0]), told
    assert '"status": "completed"' in (tmp_path / "run" / "summary.json").read_text()


def test_a_cache_entry_that_is_a_link_writes_nothing_outside(filled, tmp_path, cli_env):
    """The whole step's entry replaced by a link to a directory elsewhere: nothing is written there."""
    cache = tmp_path / "inductor"
    shutil.copytree(filled / "inductor", cache)
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in [p for p in (cache / "steps-default").iterdir() if p.name != "inductor"]:
        shutil.rmtree(entry)
        os.symlink(outside, entry)
    result = cli(cli_env, tmp_path, WHOLE_STEP, tmp_path / "run", TORCHINDUCTOR_CACHE_DIR=str(cache))
    assert list(outside.iterdir()) == []
    assert len(warnings_of(result)) == 1 and "it is not a regular file" in warnings_of(result)[0]


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    values = [dict(zip(header, row.split(","))) for row in rows[1:]]
    return [float(v["value"]) for v in values if v.get("name") == "train/loss"]


def test_float32_and_cbfloat16_compiled_into_one_cache_each_keep_their_own_losses(tmp_path, cli_env):
    """The interpreted graph gives each precision's reference; then both compile into one fresh cache at once,
    and again one after the other (loading what the other compiled): each run's losses are its own."""
    precisions = ["float32", "cbfloat16"]
    runs = {p: [*TINY, "device=csx", "loop.max_steps=6", "seed=5", f"precision={p}"] for p in precisions}
    reference = {}
    for p in precisions:
        cli(cli_env, tmp_path, [*runs[p], "backend.graph_compiler=none", f"backend.compile_dir={tmp_path / p}"],
            tmp_path / f"ref-{p}")
        reference[p] = losses(tmp_path / f"ref-{p}")
    assert reference["float32"] != reference["cbfloat16"]
    shared = [f"backend.compile_dir={tmp_path / 'shared'}", "backend.graph_compiler=inductor"]
    both = [subprocess.Popen([sys.executable, "-m", "csframework", *runs[p], *shared,
                              f"hydra.run.dir={tmp_path / f'together-{p}'}"], cwd=tmp_path, env=cli_env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in precisions]
    for proc in both:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    for p in precisions:
        cli(cli_env, tmp_path, [*runs[p], *shared], tmp_path / f"after-{p}")
    for p in precisions:
        for name in (f"together-{p}", f"after-{p}"):
            assert losses(tmp_path / name) == pytest.approx(reference[p], rel=1e-4), name


@pytest.mark.parametrize("kind, compiled", [("file", False), ("fifo", False), ("below-a-file", False),
                                            ("file", True)])
def test_an_inductor_cache_setting_that_is_no_directory_is_one_warning_not_a_traceback(tmp_path, cli_env, kind,
                                                                                        compiled):
    """``$TORCHINDUCTOR_CACHE_DIR`` a file, a FIFO or below a file: torch creates it when building the optimizer
    imports its compiler, with or without ``backend.compile``. Before: a traceback from inside torch."""
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    cache = {"file": notes, "below-a-file": notes / "cache", "fifo": tmp_path / "fifo"}[kind]
    if kind == "fifo":
        os.mkfifo(cache)
    args = WHOLE_STEP if compiled else TINY
    result = cli(cli_env, tmp_path, args, tmp_path / "run", TORCHINDUCTOR_CACHE_DIR=str(cache))
    assert "Traceback" not in result.stderr
    told = warnings_of(result)
    assert len(told) == 1 and f"compile cache {cache} not used" in told[0]
    assert notes.read_text() == "notes\n"


@pytest.mark.parametrize("which", ["inductor", "csx"])
def test_a_read_only_cache_is_at_most_one_warning_and_the_run_compiles_and_completes(filled, tmp_path, cli_env,
                                                                                    read_only, which):
    """A filled cache of the user's own that cannot be written (``chmod a-w``; for root, also immutable).
    ``backend.compile=true`` (Inductor must write its cache): one warning naming the cache and why, and a
    compile in a private directory; before: Inductor's write failed, the compile was reported failed
    (``compile_failed``: "no working C++ compiler", or its PermissionError) and the run trained eagerly.
    ``backend.compile_dir`` (CSX): a trusted read-only cache is read (a hit), no warning (as before)."""
    cache = tmp_path / which
    shutil.copytree(filled / which, cache)
    read_only(cache)
    before = sorted((p.relative_to(cache), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    if which == "inductor":
        result = cli(cli_env, tmp_path, WHOLE_STEP, tmp_path / "run", TORCHINDUCTOR_CACHE_DIR=str(cache))
    else:
        result = cli(cli_env, tmp_path, [*CSX, f"backend.compile_dir={cache}"], tmp_path / "run")
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "compile_failed" not in output, output[-3000:]
    told = warnings_of(result)
    if which == "inductor":
        assert len(told) == 1 and f"compile cache {cache} not used: {cache}: it is not writable" in told[0], told
        assert "step_compiled" in output
    else:
        assert told == [] and "cache=hit" in output, output[-3000:]
    assert '"status": "completed"' in (tmp_path / "run" / "summary.json").read_text()
    assert sorted((p.relative_to(cache), p.stat().st_mtime_ns) for p in cache.rglob("*")) == before

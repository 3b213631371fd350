"""The durable format of one checkpoint: a directory ``checkpoints/step-<global step>/`` holding

- ``state.pt``: everything ``Run.state_dict()`` returns (model, optimizer, schedule, loss scaler, loop
  position, random generators), tensors and plain values only, written with ``torch.save`` and read with
  ``torch.load(weights_only=True)``: loading cannot run code from the file;
- ``config.yaml``: the composed run config, as YAML;
- ``meta.json``: the layout version (``format``), the stage, metrics, plugin state (``on_checkpoint_save``),
  the run's id, the optimizer's class and, for each other file,
  its size and checksums: the CRC-32 of ``config.yaml``, and of every record of ``state.pt`` (a zip
  archive whose records torch already checksums as it writes them, so saving costs no extra pass). They are
  checked before anything loaded is used;
- under a sharded backend (``Backend.sharded``, ``strategy=fsdp``), ``sharded/``: the files every rank
  wrote with ``Backend.save_sharded`` (listed and checksummed in ``meta.json`` like the rest).

Writes are atomic: the directory is written under a temporary name, every file flushed and fsynced, then
renamed into place. A checkpoint is therefore complete or absent whatever kills the process.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import struct
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import torch

from ...errors import CheckpointWriteError, DamagedCheckpoint
from ...files import SafeDir
from .untrusted import read_bounded, read_json, yaml_problem

#: The layout of meta.json (3: no ``global_step``, which the state's position holds; the directory's name too).
FORMAT = 3
#: Under a sharded backend: the sub-directory of a checkpoint holding the shards every rank wrote (the
#: names ``strategy=fsdp``'s DCP writes are the ones allowed).
SHARDED = "sharded"
SHARD_NAME = re.compile(rf"{SHARDED}/(\.metadata|__\d+_\d+\.distcp)")
_CHUNK = 1 << 24
#: Bounds on what is read from disk: beyond them a file is damaged, not a reason to exhaust memory.
MAX_META_BYTES = 64 << 20
MAX_CONFIG_BYTES = 16 << 20
#: How often ``_CrcFile`` starts a background fdatasync while a file is written.
_SYNC_EVERY = 64 << 20


class _CrcFile:
    """A binary file whose size (and, with ``checksum``, CRC-32) is computed as it is written.

    Every ``_SYNC_EVERY`` bytes a background thread fdatasyncs what is written so far, so the disk works
    while the rest is serialised and the final fsync only waits for the tail (a large checkpoint is then
    durable in about the time ``torch.save`` alone takes).
    """

    def __init__(self, f, checksum: bool = True):
        self.f, self.crc, self.size, self.checksum = f, 0, 0, checksum
        self.error: OSError | None = None
        self.synced_at = 0
        self.syncer: threading.Thread | None = None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as e:  # torch.save turns it into a RuntimeError: keep the real cause
            self.error = self.error or e
            raise
        if self.checksum:
            self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        if self.size - self.synced_at >= _SYNC_EVERY and not (self.syncer and self.syncer.is_alive()):
            self.f.flush()
            self.synced_at = self.size
            self.syncer = threading.Thread(target=self._sync, name="csframework-fsync", daemon=True)
            self.syncer.start()
        return written

    def _sync(self) -> None:
        try:
            os.fdatasync(self.f.fileno())
        except OSError as e:  # reported by durable(): an error seen here may not be seen by a later fsync
            self.error = self.error or e

    def flush(self) -> None:
        self.f.flush()

    def wait_for_sync(self) -> None:
        if self.syncer is not None:
            self.syncer.join()

    def durable(self) -> None:
        """Flush, wait for the background sync, fsync; raise the first error of any of them."""
        self.wait_for_sync()
        if self.error is not None:
            raise self.error
        self.f.flush()
        os.fsync(self.f.fileno())


def _write_file(where: SafeDir, name: str, write, checksum: bool = True) -> dict:
    """Create ``name`` in ``where``, let ``write(file)`` fill it, flush and fsync; returns its size and
    CRC-32."""
    with where.atomic(name, durable=False) as f:
        out = _CrcFile(f, checksum)
        try:
            write(out)
        except Exception:
            out.wait_for_sync()
            if out.error is not None:  # a failed write (disk full ...) surfaced as another error
                raise out.error from None
            raise
        out.durable()
    return {"bytes": out.size, "crc32": f"{out.crc:08x}"} if checksum else {"bytes": out.size}


def _save_state(state: dict, f) -> None:
    """``torch.save`` with the CRC-32 of every zip record computed (torch's default; forced here)."""
    config = getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "save", None)
    if config is None or getattr(config, "compute_crc32", None) is not False:
        torch.save(state, f)
        return
    config.compute_crc32 = True
    try:
        torch.save(state, f)
    finally:
        config.compute_crc32 = False


def _zip_records(path: Path) -> dict:
    """The CRC-32 of every record of a zip archive, from its directory."""
    with zipfile.ZipFile(path) as archive:
        return {info.filename: f"{info.CRC:08x}" for info in archive.infolist()}


def _check_zip(path: Path, expected: dict) -> None:
    """Check every record of the zip archive ``path`` against its CRC-32 in ``expected`` (and in the
    archive's own directory), reading the file once in large blocks."""
    def damaged(why: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"checkpoint {path.parent}: {path.name} {why}")

    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb", buffering=0) as f:
            infos = archive.infolist()
            if {info.filename: f"{info.CRC:08x}" for info in infos} != expected:
                raise damaged("holds other records than were written (damaged)")
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:  # torch stores; anything else: zipfile checks
                    with archive.open(info) as record:
                        while record.read(_CHUNK):
                            pass
                    continue
                f.seek(info.header_offset)
                header = f.read(30)
                if len(header) != 30 or header[:4] != b"PK\x03\x04":
                    raise damaged(f"has a damaged record header ({info.filename})")
                name_length, extra_length = struct.unpack("<HH", header[26:30])
                f.seek(info.header_offset + 30 + name_length + extra_length)
                remaining, crc = info.compress_size, 0
                while remaining:
                    n = f.readinto(view[:min(remaining, _CHUNK)])
                    if not n:
                        raise damaged(f"ends inside record {info.filename} (truncated)")
                    crc = zlib.crc32(view[:n], crc)
                    remaining -= n
                if crc != info.CRC:
                    raise damaged(f"fails its checksum in record {info.filename} (damaged)")
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error) as e:
        if isinstance(e, DamagedCheckpoint):
            raise
        raise damaged(f"fails its checksum ({e})") from e


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _commit(root: SafeDir, tmp: str, final: str) -> None:
    """Rename the complete temporary directory into place (replacing a checkpoint of the same step)."""
    if root.kind(final) is not None:
        old = f".old-{final}.{secrets.token_hex(8)}"
        root.rename(final, old)
        root.rename(tmp, final)
        root.remove(old)
    else:
        root.rename(tmp, final)


def temporary_dir(root: Path, name: str) -> SafeDir:
    """A new temporary directory for checkpoint ``name`` in ``root`` (unpredictable name, created
    exclusively, writable by this user only); under ``strategy=fsdp`` every rank writes its shards into
    its ``sharded/`` before rank 0 completes and commits it (``write_checkpoint``)."""
    return SafeDir(root).private_dir(f"tmp-{name}", mode=0o755)


def write_checkpoint(root: Path, name: str, state: dict, meta: dict, config_yaml: str,
                     sharded: SafeDir | None = None) -> Path:
    """Write one checkpoint atomically into ``root/name``; returns its path. ``sharded``: the temporary
    directory (``temporary_dir``) the ranks have written their shards into; they are listed and
    checksummed with the rest.

    Raises ``CheckpointWriteError`` (naming the path) when the disk refuses; the temporary directory is
    removed and the existing checkpoints are untouched. ``UnsafePathError`` when ``root`` is a link.
    """
    final = root / name
    checkpoints = SafeDir(root)
    tmp = sharded
    try:
        if tmp is None:
            tmp = temporary_dir(root, name)
        files = {"state.pt": _write_file(tmp, "state.pt", lambda f: _save_state(state, f), checksum=False),
                 "config.yaml": _write_file(tmp, "config.yaml", lambda f: f.write(config_yaml.encode()))}
        files["state.pt"]["records"] = _zip_records(tmp / "state.pt")
        if sharded is not None:
            shards = tmp.sub(SHARDED, create=False)
            for shard in sorted(shards.names()):
                files[f"{SHARDED}/{shard}"] = {"bytes": os.stat(shards / shard, follow_symlinks=False).st_size,
                                               "crc32": file_crc32(shards / shard)}
            shards.fsync()
        # Python's JSON, not strict: plugin state may hold NaN or infinities (``best = inf``), read back as
        # floats; it is checked to hold nothing else (plugin_checkpoint_state) and read only by csframework
        tmp.write("meta.json", json.dumps(dict(meta, format=FORMAT, files=files), indent=2))
        _commit(checkpoints, tmp.parts[-1], name)
    except OSError as e:
        if tmp is not None:
            checkpoints.remove(tmp.parts[-1])
        raise CheckpointWriteError(f"checkpoint: could not write {final} ({e.strerror or e}); the previous "
                                   "checkpoints are intact") from e
    return final


def _meta_problem(meta) -> str | None:
    """What in ``meta`` (parsed meta.json) is not what ``write_checkpoint`` writes; None if nothing."""
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return "it has no files table"
    for name, entry in meta["files"].items():
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0:
            return f"files.{name} has no size"
        if name == "config.yaml" and size > MAX_CONFIG_BYTES:
            return f"files.config.yaml is larger than {MAX_CONFIG_BYTES} bytes"
        records = entry.get("records")
        if records is not None and not (isinstance(records, dict)
                                        and all(isinstance(v, str) for v in records.values())):
            return f"files.{name}.records is not a table of checksums"
    metrics = meta.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(type(v) in (int, float) for v in metrics.values()):
        return "metrics is not a table of numbers"
    if not isinstance(meta.get("plugins") or {}, dict):
        return "plugins is not a table"
    return None


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json, checked to be what ``write_checkpoint`` writes (``DamagedCheckpoint``)."""
    try:
        meta = read_json(path / "meta.json", MAX_META_BYTES)
    except OSError as e:
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json is missing or unreadable "
                                f"({e.strerror or e})") from e
    except ValueError as e:
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json is damaged ({e})") from e
    problem = _meta_problem(meta)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json is damaged ({problem})")
    return meta


def _check_file(path: Path, expected: dict) -> None:
    if path.is_symlink():
        raise DamagedCheckpoint(f"checkpoint {path.parent}: {path.name} is a symbolic link, which "
                                "csframework never writes")
    if not path.is_file():
        raise DamagedCheckpoint(f"checkpoint {path.parent}: {path.name} is missing")
    size = path.stat().st_size
    if size != expected.get("bytes"):
        raise DamagedCheckpoint(f"checkpoint {path.parent}: {path.name} has {size} bytes, "
                                f"{expected.get('bytes')} were written (truncated or damaged)")
    if "records" in expected:
        _check_zip(path, expected["records"])
    elif file_crc32(path) != expected.get("crc32"):
        raise DamagedCheckpoint(f"checkpoint {path.parent}: {path.name} fails its checksum (damaged)")


def read_checkpoint(path: Path, read_shard_metadata: Callable[[Path], object] | None = None
                    ) -> tuple[dict, dict]:
    """``(state, meta)`` of a checkpoint directory, after checking every file's size and
    checksum. Nothing in it can run code: ``state.pt`` is read with ``torch.load(weights_only=True)``,
    the rest is JSON and YAML.

    ``read_shard_metadata``: for a sharded checkpoint, the sharded backend's check of ``sharded/.metadata``
    (``Backend.read_shard_metadata``: it reads the file without running code from it, and raises when it is
    not the backend's metadata); without it the shards are checked by size and checksum only (the plugin
    passes the run's backend's when the run is sharded; a whole-state run refuses a sharded checkpoint).

    Raises ``DamagedCheckpoint`` naming the path when it is incomplete, damaged or refused.
    """
    path = Path(path)
    meta = read_meta(path)
    files = meta["files"]
    shards = {name for name in files if name.startswith(SHARDED + "/")}
    if ("state.pt" not in files or not set(files) - shards <= {"state.pt", "config.yaml"}
            or not all(SHARD_NAME.fullmatch(name) for name in shards)
            or (shards and f"{SHARDED}/.metadata" not in shards)):
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json lists other files than state.pt, config.yaml "
                                f"and {SHARDED}/ (.metadata and __<rank>_<n>.distcp)")
    if shards and SafeDir(path).kind(SHARDED) != "dir":  # its files would be read through the link
        raise DamagedCheckpoint(f"checkpoint {path}: {SHARDED}/ is not a real directory (a symbolic link, which "
                                "csframework never writes, or a file)")
    for name, expected in files.items():
        if name != "state.pt":
            _check_file(path / name, expected)
    if "config.yaml" in files:
        damage = yaml_problem(read_config_yaml(path))
        if damage:
            raise DamagedCheckpoint(f"checkpoint {path}: config.yaml is damaged ({damage})")
    # The big file's checksum is verified while torch.load reads it (both read the same pages); a
    # loaded state is used only if the checksum holds. weights_only=True never runs code either way.
    problem: list[BaseException] = []

    def verify():
        try:
            _check_file(path / "state.pt", files["state.pt"])
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            problem.append(e)

    checker = threading.Thread(target=verify, name="csframework-checksum")
    checker.start()
    state, load_error = None, None
    try:
        with SafeDir(path).reader("state.pt") as f:  # a regular file, through no link, never a FIFO
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file, or one holding code: refused below
        load_error = e
    finally:
        checker.join()
    if problem:
        raise problem[0]
    if load_error is not None:
        raise DamagedCheckpoint(f"checkpoint {path}: refused to load state.pt "
                                f"({type(load_error).__name__}: {str(load_error).splitlines()[0]})") from load_error
    if not isinstance(state, dict) or ("model" not in state and not (shards and state.get("sharded"))):
        raise DamagedCheckpoint(f"checkpoint {path}: state.pt holds no run state")
    if shards and read_shard_metadata is not None:  # the backend reads its metadata, running no code
        try:
            read_shard_metadata(path / SHARDED / ".metadata")
        except Exception as e:  # noqa: BLE001 - whatever reading it raises, the checkpoint is damaged
            raise DamagedCheckpoint(f"checkpoint {path}: refused to load {SHARDED}/.metadata ({e})") from e
    return state, meta


def read_config_yaml(path: Path) -> str:
    """The composed config a checkpoint was saved with (YAML text; empty if it has none)."""
    try:
        return read_bounded(Path(path) / "config.yaml", MAX_CONFIG_BYTES).decode("utf-8")
    except (OSError, ValueError):
        return ""

"""The checkpoint plugin: save every ``checkpoint.every_steps``, when a stage ends and when a signal stops
the run; keep the newest ``keep_last``; resume (``checkpoint.resume=auto`` or a path).

Format: a checkpoint is a directory ``checkpoints/step-<global step>/`` holding

- ``state.pt``: everything ``Run.state_dict()`` returns (model, optimizer, schedule, loss scaler, loop
  position, random generators), tensors and plain values only, written with ``torch.save`` and read with
  ``torch.load(weights_only=True)``: loading cannot run code from the file;
- ``config.yaml``: the composed run config, as YAML;
- ``meta.json``: step, stage, metrics, plugin state (``on_checkpoint_save``) and, for each other file,
  its size and checksums: the CRC-32 of ``config.yaml``, and of every record of ``state.pt`` (a zip
  archive whose records torch already checksums as it writes them, so saving costs no extra pass). They are
  checked before anything loaded is used.

Writes are atomic: the directory is written under a temporary name, every file flushed and fsynced, then
renamed into place; ``checkpoints/index.json`` (the complete checkpoints, oldest first) is replaced last.
A checkpoint is therefore complete or absent whatever kills the process. Resume tries the newest
checkpoint and falls back to older ones when one is damaged, with a warning naming it.

Everything read from disk is data, never a path to obey (docs/durability.md, "Threat model"): checkpoint
names come only from listing ``checkpoints/`` (real directories named ``step-<8 digits>``, not links, lying
inside it), the index is a hint checked against that listing and rebuilt when wrong, pruning deletes only
such directories, and every JSON/YAML file is read bounded in size and depth, through no link.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import secrets
import stat
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from ..errors import (CheckpointWriteError, ConfigError, DamagedCheckpoint, PluginError, UnreadableCheckpoints,
                      UnsafePathError)
from ..files import SafeDir
from ..hookspecs import hookimpl
from ..jsonout import dumps

INDEX = "index.json"
FORMAT = 2
#: strategy=fsdp: the sub-directory of a checkpoint holding the shards every rank wrote (DCP's files).
SHARDED = "sharded"
SHARD_NAME = re.compile(rf"{SHARDED}/(\.metadata|__\d+_\d+\.distcp)")
_CHUNK = 1 << 24
#: The names the framework gives checkpoint directories: ``step-`` and the global step, 8 digits or more.
NAME = re.compile(r"step-(?:\d{8}|[1-9]\d{8,})")
#: Temporary names the framework writes under: unpredictable (``SafeDir.private_dir``, ``SafeDir.atomic``).
_TEMPORARY = re.compile(r"\.(?:tmp|old)-step-\d+\.[0-9a-f]{16}|\.index\.json\.[0-9a-f]{16}\.tmp")
#: Bounds on what is read from disk: beyond them a file is damaged, not a reason to exhaust memory.
MAX_INDEX_BYTES = 1 << 20
MAX_META_BYTES = 64 << 20
MAX_CONFIG_BYTES = 16 << 20
#: What the plugins' state may take in meta.json (the rest of ``MAX_META_BYTES`` is the files table).
MAX_PLUGIN_STATE_BYTES = MAX_META_BYTES - (1 << 20)
MAX_DEPTH = 64


# -- untrusted files ------------------------------------------------------------------------------------
def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, opened through no symbolic link (a FIFO or device is not
    read either). ``ValueError`` saying why when it is not such a file or holds more than ``max_bytes``;
    ``OSError`` when it cannot be opened (``FileNotFoundError`` when absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError("it is a symbolic link, which csframework never writes") from e
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"it is larger than {max_bytes} bytes")
    return data


def _depth(value) -> int:
    """How deeply lists and dicts nest in ``value`` (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def read_json(path: Path, max_bytes: int):
    """A JSON file read as untrusted data (``read_bounded``, nested at most ``MAX_DEPTH`` deep);
    ``ValueError`` saying what is wrong, ``OSError`` when it cannot be opened."""
    data = read_bounded(path, max_bytes)
    try:
        value = json.loads(data)
    except RecursionError:  # json's parser recurses once per level
        raise ValueError(f"it is nested deeper than {MAX_DEPTH} levels") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"it is nested deeper than {MAX_DEPTH} levels")
    return value


def _yaml_problem(text: str) -> str | None:
    """Why ``text`` is not a config csframework wrote (None if it could be), from the parser's events
    alone: nothing is constructed, so aliases (a YAML bomb) and deep nesting are caught before they cost."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                return "it uses YAML aliases, which csframework never writes"
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"it is nested deeper than {MAX_DEPTH} levels"
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError as e:
        return f"it is not valid YAML ({' '.join(str(e).split())[:200]})"
    return None


# -- files ----------------------------------------------------------------------------------------------
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
    previous = getattr(config, "compute_crc32", None)
    try:
        if previous is False:
            config.compute_crc32 = True
        torch.save(state, f)
    finally:
        if previous is False:
            config.compute_crc32 = previous


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
    if type(meta.get("global_step", 0)) is not int:
        return "global_step is not an integer"
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


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """``(state, meta)`` of a checkpoint directory, after checking every file's size and
    checksum. Nothing in it can run code: ``state.pt`` is read with ``torch.load(weights_only=True)``,
    the rest is JSON and YAML.

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
    for name, expected in files.items():
        if name != "state.pt":
            _check_file(path / name, expected)
    if "config.yaml" in files:
        problem = _yaml_problem(read_config_yaml(path))
        if problem:
            raise DamagedCheckpoint(f"checkpoint {path}: config.yaml is damaged ({problem})")
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
    if shards:  # DCP's metadata is a pickle: only its own types may be in it
        import pickle

        from ..backends.fsdp import read_metadata

        try:
            read_metadata(path / SHARDED / ".metadata")
        except Exception as e:  # noqa: BLE001 - whatever reading it raises, the checkpoint is damaged
            raise DamagedCheckpoint(f"checkpoint {path}: refused to load {SHARDED}/.metadata ({e})") from e
    return state, meta


def read_config_yaml(path: Path) -> str:
    """The composed config a checkpoint was saved with (YAML text; empty if it has none)."""
    try:
        return read_bounded(Path(path) / "config.yaml", MAX_CONFIG_BYTES).decode("utf-8")
    except (OSError, ValueError):
        return ""


def _step(name: str) -> int:
    return int(name[len("step-"):])


def scan_checkpoints(root: Path) -> list[str]:
    """The framework's checkpoint directories in ``root``, oldest first: real directories (not links)
    named by ``NAME``, lying in ``root`` once resolved. Nothing else there is ever a checkpoint.
    ``UnreadableCheckpoints`` when ``root`` exists but cannot be listed."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UnreadableCheckpoints(f"cannot list the checkpoints in {root} ({e.strerror or e})") from e
    real = os.path.realpath(root)
    names = [e.name for e in entries if NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
             and os.path.realpath(e.path) == os.path.join(real, e.name)]
    return sorted(names, key=_step)


def _index_problem(index, found: list[str]) -> str | None:
    """What is wrong with a parsed index, given the checkpoint directories there are; None if nothing."""
    if not isinstance(index, dict) or not isinstance(index.get("checkpoints"), list):
        return 'it is not {"checkpoints": [names]}'
    seen = set()
    for name in index["checkpoints"]:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return f"it lists {json.dumps(name)[:80]}, which is not a checkpoint name (step-NNNNNNNN)"
        if name in seen:
            return f"it lists {name} twice"
        if name not in found:
            return f"it lists {name}, which is not a checkpoint directory there"
        seen.add(name)
    return None


def checkpoint_names(root: Path) -> tuple[list[str], str | None]:
    """The complete checkpoints in ``root``, oldest first, and what is wrong with its index (None when it
    is right or absent). The index is a hint, written after each checkpoint is complete: when it is
    right its order is used (a checkpoint renamed into place but not yet indexed is left out); when it
    is wrong the directory's own checkpoints are, by step."""
    found = scan_checkpoints(root)
    try:
        index = read_json(root / INDEX, MAX_INDEX_BYTES)
    except FileNotFoundError:
        return found, None
    except (OSError, ValueError) as e:
        return found, f"it is unreadable or damaged ({getattr(e, 'strerror', None) or e})"
    problem = _index_problem(index, found)
    return (found, problem) if problem else (list(index["checkpoints"]), None)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first (``checkpoint_names``)."""
    return [root / name for name in checkpoint_names(root)[0]]


def read_best(root: Path) -> dict | None:
    """The index's ``best`` entry (``checkpoint.keep_best``: ``name``, ``metric``, ``value``), or ``None``
    when there is none or it does not name one of the checkpoint directories in ``root``."""
    try:
        best = read_json(root / INDEX, MAX_INDEX_BYTES).get("best")
        found = scan_checkpoints(root)
    except (OSError, ValueError, AttributeError, UnreadableCheckpoints):
        return None
    if (isinstance(best, dict) and best.get("name") in found and isinstance(best.get("metric"), str)
            and isinstance(best.get("value"), (int, float))):
        return best
    return None


def resume_source(target: Path) -> tuple[Path, bool]:
    """What ``checkpoint.resume=<target>`` names, resolved: ``(a checkpoint directory, False)``, or
    ``(a checkpoints/ directory, True)`` whose newest good checkpoint is meant (for a run directory, its
    ``checkpoints/``). ``ConfigError`` naming the path and what it lacks when it is neither."""
    target = Path(os.path.realpath(target))
    if not target.is_dir():
        raise ConfigError(f"checkpoint.resume: {target} is not a csframework checkpoint: it is a file, and a "
                          "checkpoint is a directory holding meta.json, state.pt and config.yaml; give a "
                          "checkpoint, checkpoints/ or run directory")
    if (target / "meta.json").exists() or (target / "state.pt").exists():
        return target, False
    if (target / "checkpoints").is_dir():
        return target / "checkpoints", True
    if not scan_checkpoints(target):
        raise ConfigError(f"checkpoint.resume: {target} is not a csframework checkpoint: it holds no meta.json, "
                          "no checkpoints/ and no step-NNNNNNNN/ checkpoint directories")
    return target, True


def _write_index(root: Path, index: dict) -> None:
    """Replace ``root/index.json`` atomically (written last, after the checkpoint it lists is complete)."""
    SafeDir(root).write(INDEX, dumps(index))


def _remove_checkpoint(root: Path, name: str) -> None:
    """Delete one of the framework's checkpoint directories in ``root``; any other name is left alone
    (``SafeDir.remove``: the tree is walked by descriptor, no link in it followed)."""
    if name in scan_checkpoints(root):
        SafeDir(root).remove(name)


# -- compatibility --------------------------------------------------------------------------------------
def _flatten(node, prefix: str) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def _config_differences(saved_yaml: str, config, section: str) -> list[str]:
    try:
        saved = OmegaConf.to_container(OmegaConf.create(saved_yaml or "{}")).get(section)
    except Exception:  # noqa: BLE001 - a config we cannot read names nothing
        return []
    now = OmegaConf.to_container(OmegaConf.structured(config)).get(section)
    before, after = _flatten(saved, section), _flatten(now, section)
    return [f"{key} is {before.get(key, '(unset)')} in the checkpoint, {after.get(key, '(unset)')} now"
            for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


def model_mismatch(model: torch.nn.Module, saved: dict) -> list[str]:
    """How ``saved`` (a model state dict) does not fit ``model``: missing, unexpected or reshaped tensors."""
    current = model.state_dict()
    problems = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"the model has {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                        + " which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint has {unexpected[0]}"
                        + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else "") + " which the model lacks")
    for key, value in current.items():
        if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape):
            problems.append(f"{key} is {list(saved[key].shape)} in the checkpoint, {list(value.shape)} in the model")
            break
    return problems


# -- the plugin -----------------------------------------------------------------------------------------
class CheckpointPlugin:
    name = "checkpoint"

    def __init__(self):
        self.saved_step = None
        self.seen_step = None
        self.every: int | None = None  # the stage's checkpoint.every_steps
        self.config_yaml: str | None = None  # the run's config as YAML, made at the first save
        self.reported: dict[str, int] = {}  # metric name -> the step it was last reported at
        self.shards: SafeDir | None = None  # strategy=fsdp: the temporary directory the ranks write into
        self.monitor_checked = False  # keep_best.monitor compared with what the first evaluation reported

    @staticmethod
    def _root(run) -> Path:
        """The run's ``checkpoints/``: a real directory of the run directory, or absent. Anything else (a
        link to another run's checkpoints, a file) is refused naming it: resuming or pruning through it
        would read or delete what this run does not own."""
        kind = run.files.kind("checkpoints")
        if kind not in (None, "dir"):
            raise UnsafePathError(f"{run.files / 'checkpoints'}: it is a {'symbolic link' if kind == 'link' else kind}"
                                  ", not the run's own checkpoints directory; remove it (csframework never "
                                  "creates one)")
        return run.files / "checkpoints"

    def _config_yaml(self, run) -> str:
        """The run's config as a checkpoint's ``config.yaml`` (made once: a plugin instance serves one run,
        whose config does not change); ``ConfigError`` when resume could not read it back."""
        if self.config_yaml is None:
            text = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(run.config)))
            size = len(text.encode("utf-8"))
            if size > MAX_CONFIG_BYTES:
                sections = {f.name: len(repr(getattr(run.config, f.name))) for f in dataclasses.fields(run.config)}
                largest = max(sections, key=sections.get)
                raise ConfigError(f"{largest}: the run's config is {size} bytes as YAML, more than the "
                                  f"{MAX_CONFIG_BYTES} bytes (16 MiB) a checkpoint's config.yaml may hold, so no "
                                  f"checkpoint of this run could be resumed; its largest section is {largest!r} "
                                  f"(about {sections[largest]} bytes): keep large data in files and put their "
                                  "paths in the config")
            self.config_yaml = text
        return self.config_yaml

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        # what a checkpoint could not be read back with is refused before training (the YAML takes
        # tens of ms to make: only for a config whose repr is near the limit, else at the first save)
        if run.rank == 0 and run.mode == "fit" and len(repr(run.config)) > MAX_CONFIG_BYTES // 16:
            self._config_yaml(run)
        if not self.restore(run) and run.mode == "validate" and run.global_step == 0:  # not after a fit
            run.log.warning("validating_initial_weights", resume=run.config.checkpoint.resume,
                            fix="set checkpoint.resume=<a run directory or checkpoint> to evaluate trained weights")
        if run.rank == 0:
            self._name_best(run, read_best(self._root(run)))

    @hookimpl
    def on_log_metrics(self, metrics, step):
        for name in metrics:
            self.reported[name] = step

    @hookimpl
    def on_eval_end(self, run, metrics):
        """At the first evaluation, a ``keep_best.monitor`` no metric is named (a typo) is said once."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        if monitor and not self.monitor_checked:
            self.monitor_checked = True
            if monitor not in metrics and monitor not in run.metrics:
                run.log.warning("keep_best_monitor_not_reported", monitor=monitor,
                                reported=sorted({*metrics, *run.metrics}),
                                fix="set checkpoint.keep_best.monitor to one of the reported metrics; "
                                    "until then no best checkpoint is kept")

    def _best(self, run, root: Path, name: str) -> dict | None:
        """The best checkpoint after saving ``name``: it, if ``keep_best.monitor`` was reported at this
        step with a better value than the previous best, else the previous best (``None``: keep none)."""
        keep_best = run.stage_config.checkpoint.keep_best
        monitor = keep_best.monitor
        if not monitor:
            return None
        previous = read_best(root)
        if previous is not None and previous["metric"] != monitor:
            previous = None
        value = run.metrics.get(monitor)
        if self.reported.get(monitor) != run.global_step or value is None or not math.isfinite(value):
            return previous
        if previous is not None and (value >= previous["value"] if keep_best.mode.value == "min"
                                     else value <= previous["value"]):
            return previous
        return {"name": name, "metric": monitor, "value": value}

    @staticmethod
    def _name_best(run, best: dict | None) -> None:
        if best:
            run.summary_extra["best_checkpoint"] = {"path": f"checkpoints/{best['name']}", "metric": best["metric"],
                                                    "value": best["value"]}
        else:
            run.summary_extra.pop("best_checkpoint", None)

    def restore(self, run) -> bool:
        """Load ``checkpoint.resume`` into ``run``; ``True`` when a checkpoint was loaded."""
        resume = run.config.checkpoint.resume
        if resume == "never":
            return False
        if resume == "auto":
            source, fallback = self._root(run), True
        else:
            source, fallback = resume_source(Path(resume))
        candidates = [source]
        if fallback:
            try:  # this run's index is repaired; another run's is only read
                names = self._checkpoints(run, source, rewrite=resume == "auto")
            except UnreadableCheckpoints as e:
                raise ConfigError(f"checkpoint.resume={resume}: {e}; make it a readable directory, or "
                                  "start afresh in another run directory (hydra.run.dir=...)") from e
            if not names and resume != "auto":
                raise ConfigError(f"checkpoint.resume: no complete checkpoint in {source}")
            candidates = [source / name for name in reversed(names)]
        damaged = []
        for path in candidates:
            try:
                state, meta = read_checkpoint(path)
            except DamagedCheckpoint as e:
                if not fallback:
                    raise ConfigError(f"checkpoint.resume: {e}") from e
                run.log.warning("checkpoint_damaged", path=str(path), error=str(e),
                                action="falling back to the previous checkpoint")
                damaged.append(path.name)
                continue
            self._load(run, path, state, meta)
            return True
        if damaged:  # starting over would, at the first save, prune checkpoints someone may still need
            raise ConfigError(f"checkpoint.resume={resume}: found {len(damaged)} checkpoint(s) in {source} but "
                              f"could read none ({', '.join(damaged)}; events.jsonl says why); start afresh "
                              "with checkpoint.resume=never, or in a new run directory (hydra.run.dir=...)")
        return False

    def _checkpoints(self, run, root: Path, rewrite: bool) -> list[str]:
        """``checkpoint_names(root)``; a wrong index is reported naming it and, with ``rewrite``, rebuilt."""
        names, problem = checkpoint_names(root)
        if problem:
            run.log.warning("checkpoint_index_rebuilt", path=str(root / INDEX), problem=problem,
                            action="using the checkpoint directories found there instead", checkpoints=names)
            if rewrite and run.rank == 0:
                try:
                    _write_index(root, {"checkpoints": names})
                except OSError as e:  # the next save reports it (CheckpointWriteError); resuming needs none
                    run.log.warning("checkpoint_index_not_rewritten", path=str(root / INDEX),
                                    error=e.strerror or str(e))
        return names

    def _load(self, run, path: Path, state: dict, meta: dict) -> None:
        sharded = bool(state.get("sharded"))
        if sharded != run.backend.sharded:
            raise ConfigError(f"checkpoint {path} does not fit this run: it was written "
                              f"{'sharded (strategy=fsdp)' if sharded else 'whole (strategy single or ddp)'}; "
                              "resume it with the same kind of strategy")
        problems = [] if sharded else model_mismatch(run.model, state["model"])
        if problems:
            why = _config_differences(read_config_yaml(path), run.config, "model")
            raise ConfigError(f"checkpoint {path} does not fit this run: {'; '.join(problems)}"
                              + (f" (config: {'; '.join(why)})" if why else ""))
        def check_optimizer():
            saved = meta.get("optimizer")
            if saved and saved != type(run.optimizer).__name__:
                raise ConfigError(f"checkpoint {path} does not fit this run: optimizer.name: its state is "
                                  f"{saved}'s, this run uses {type(run.optimizer).__name__}")

        if state["loop"].get("stage_index") == run.stage_index:
            check_optimizer()
        try:
            run.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:  # e.g. an optimizer with other parameter groups
            raise ConfigError(f"checkpoint {path} does not fit this run: {type(e).__name__}: "
                              f"{str(e).splitlines()[0]}") from e
        if sharded:  # every rank loads its shards (DCP reshards to this run's number of ranks)
            from ..backends import fsdp

            try:
                fsdp.load(run.model, run.optimizer, path / SHARDED,
                          {n.split("/", 1)[1] for n in meta["files"] if n.startswith(SHARDED + "/")})
            except (ValueError, KeyError, RuntimeError) as e:
                raise ConfigError(f"checkpoint {path} does not fit this run: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}") from e
        check_optimizer()  # the stage it was saved in is entered now
        run.metrics.update(meta.get("metrics") or {})
        run.hooks.on_checkpoint_load(run=run, state=meta.get("plugins") or {})
        self.saved_step = self.seen_step = run.global_step
        run.log.info("resumed", path=str(path), step=run.global_step, stage=run.stage)

    @hookimpl
    def on_train_start(self, run):
        self.seen_step = run.global_step  # a step ends when the global step moves past this
        self.every = run.stage_config.checkpoint.every_steps  # read once a stage, not at every step
        if run.rank == 0:  # the run directory's lock is held: no other writer is alive
            _remove_stale(self._root(run))

    @hookimpl(trylast=True)
    def on_train_batch_end(self, run):
        state = run.state
        step = state.global_step
        if step == self.seen_step:  # not the last batch of a step
            return
        self.seen_step = step
        if state.stopping or (self.every and step % self.every == 0):
            self.save(run)

    @hookimpl
    def on_train_end(self, run):
        if run.stage_config.checkpoint.save_at_end and self.saved_step != run.global_step:
            self.save(run)

    def save(self, run) -> Path | None:
        """Write a checkpoint of ``run`` now (rank 0; under fsdp every rank writes its shards first) and prune
        to ``keep_last``.

        Refuses (``NonFiniteLossError``) when the run has gone non-finite since the last log, so the last
        good checkpoint is never replaced by a non-finite state.
        """
        sharded = run.backend.sharded
        if run.rank != 0 and not sharded:
            return None
        run.flush_metrics()
        run.check_finite()
        root = self._root(run)
        run.files.sub("checkpoints")
        name = f"step-{run.global_step:08d}"
        if sharded:  # every rank writes its shards (DCP) into rank 0's temporary directory, then rank 0
            self._write_shards(run, root, name)  # completes the checkpoint and says whether it committed
            if run.rank != 0:
                error = run.backend.broadcast(None)
                if error:
                    raise CheckpointWriteError(f"checkpoint: rank 0 failed to complete it: {error}")
                self.saved_step = run.global_step
                return None
            try:
                path = self._complete(run, root, name, sharded)
            except BaseException as e:
                run.backend.broadcast(f"{type(e).__name__}: {e}")
                raise
            run.backend.broadcast(None)
            return path
        return self._complete(run, root, name, sharded)

    def _write_shards(self, run, root: Path, name: str) -> None:
        """Every rank: write this rank's shards of the model and optimizer into rank 0's temporary directory."""
        from ..backends import fsdp

        where = None
        if run.rank == 0:
            try:
                self.shards = temporary_dir(root, name)
                where = str(self.shards.sub(SHARDED).path)
            except OSError:
                pass
        where = run.backend.broadcast(where)  # also a barrier: the directory exists from here on
        if where is None:
            raise CheckpointWriteError(f"checkpoint: could not create a temporary directory in {root}; the "
                                       "previous checkpoints are intact")
        fsdp.save(run.model, run.optimizer, Path(where))

    def _complete(self, run, root: Path, name: str, sharded: bool) -> Path:
        """Rank 0: write the checkpoint (around the shards, if ``sharded``), index it, prune to keep_last."""
        plugin_state = plugin_checkpoint_state(run)
        meta = {"global_step": run.global_step, "stage": run.stage, "plugins": plugin_state,
                "metrics": dict(run.metrics), "run_id": run.run_id, "optimizer": type(run.optimizer).__name__}
        path = write_checkpoint(root, name, run.state_dict(), meta, self._config_yaml(run),
                                sharded=self.shards if sharded else None)
        self.shards = None
        kept = [n for n in self._checkpoints(run, root, rewrite=False) if n != name] + [name]
        retained = kept[-run.stage_config.checkpoint.keep_last:]
        best = self._best(run, root, name)
        index: dict = {"checkpoints": retained}
        if best:  # kept besides keep_last
            index["checkpoints"] = retained = sorted(set(retained) | {best["name"]}, key=_step)
            index["best"] = best
        try:
            _write_index(root, index)
        except OSError as e:
            raise CheckpointWriteError(f"checkpoint: could not update {root / INDEX} ({e.strerror or e}); "
                                       f"{path} is complete and the previous checkpoints are intact") from e
        for old in kept:
            if old not in retained:
                _remove_checkpoint(root, old)
        self._name_best(run, best)
        self.saved_step = run.global_step
        run.log.info("checkpoint_saved", path=str(path))
        return path


def plugin_checkpoint_state(run) -> dict:
    """The ``on_checkpoint_save`` state, checked after each implementation's call: a value that JSON cannot
    hold is a ``PluginError`` naming the plugin whose call put it there and where it is, raised before
    anything is written (the run fails; the previous checkpoints stay complete and indexed). NaN and
    infinities are allowed: Python's ``json`` writes and reads them back (``best = float("inf")``)."""
    state: dict = {}
    for plugin, _ in run.hooks.each("on_checkpoint_save", run=run, state=state):
        problem = json_problem(state, "state")
        if problem:
            raise PluginError(plugin, "on_checkpoint_save", TypeError(
                f"{problem}: put only JSON values (dicts with string keys, lists, strings, numbers, booleans, "
                f"None) into the state; no checkpoint of step {run.global_step} was written, the previous "
                "checkpoints are intact"))
        size = len(json.dumps(state))
        if size > MAX_PLUGIN_STATE_BYTES:  # else meta.json would be too large for resume to read back
            raise PluginError(plugin, "on_checkpoint_save", ValueError(
                f"the plugins' checkpoint state is {size} bytes as JSON, more than the {MAX_PLUGIN_STATE_BYTES} "
                f"bytes a checkpoint's meta.json keeps for it; keep large data in files of its own; no "
                f"checkpoint of step {run.global_step} was written, the previous checkpoints are intact"))
    return state


def json_problem(value, where: str, _path: tuple = ()) -> str | None:
    """``None`` if ``json.dumps`` can write ``value``, else which part of it cannot (``state['a'][2] is of
    type Tensor ...``)."""
    if id(value) in _path:
        return f"{where} refers back to itself (a circular reference)"
    try:
        json.dumps(value)
        return None
    except (TypeError, ValueError, RecursionError):
        pass
    path = _path + (id(value),)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{where} has a key of type {type(key).__name__} ({key!r:.40})"
            found = json_problem(item, f"{where}[{key!r}]", path)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = json_problem(item, f"{where}[{i}]", path)
            if found:
                return found
    return f"{where} is of type {type(value).__name__} ({value!r:.40})"


def _remove_stale(root: Path) -> None:
    """Temporary directories and files left by a writer that died (never part of a checkpoint): only the
    names the framework writes under. Called while this run holds the run directory's lock."""
    checkpoints = SafeDir(root)
    for name in checkpoints.names():
        if _TEMPORARY.fullmatch(name):
            checkpoints.remove(name)

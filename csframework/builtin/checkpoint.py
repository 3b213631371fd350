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
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..errors import ConfigError, CsfError
from ..plugins import hookimpl
from .metrics import write_json_atomic

INDEX = "index.json"
FORMAT = 2
_CHUNK = 1 << 24


class CheckpointWriteError(CsfError):
    """A checkpoint could not be written (disk full, permissions ...); the previous ones are intact."""


class DamagedCheckpoint(ValueError):
    """A checkpoint directory is incomplete, fails its checksums, or holds something other than data."""


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


def _write_file(path: Path, write, checksum: bool = True) -> dict:
    """Create ``path``, let ``write(file)`` fill it, flush and fsync; returns its size and CRC-32."""
    with open(path, "wb") as f:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Rename the complete temporary directory into place (replacing a checkpoint of the same step)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_checkpoint(root: Path, name: str, state: dict, meta: dict, config_yaml: str) -> Path:
    """Write one checkpoint atomically into ``root/name``; returns its path.

    Raises ``CheckpointWriteError`` (naming the path) when the disk refuses; the temporary directory is
    removed and the existing checkpoints are untouched.
    """
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files = {"state.pt": _write_file(tmp / "state.pt", lambda f: _save_state(state, f), checksum=False),
                 "config.yaml": _write_file(tmp / "config.yaml", lambda f: f.write(config_yaml.encode()))}
        files["state.pt"]["records"] = _zip_records(tmp / "state.pt")
        write_json_atomic(tmp / "meta.json", dict(meta, format=FORMAT, files=files))
        _fsync_dir(tmp)
        _commit(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint: could not write {final} ({e.strerror or e}); the previous "
                                   "checkpoints are intact") from e
    return final


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if not isinstance(meta.get("files"), dict) or not all(isinstance(v, dict) for v in meta["files"].values()):
            raise KeyError("files")
        return meta
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json is missing or damaged ({e})") from e


def _check_file(path: Path, expected: dict) -> None:
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
    if "state.pt" not in files or not set(files) <= {"state.pt", "config.yaml"}:
        raise DamagedCheckpoint(f"checkpoint {path}: meta.json lists other files than state.pt and config.yaml")
    for name, expected in files.items():
        if name != "state.pt":
            _check_file(path / name, expected)
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
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file, or one holding code: refused below
        load_error = e
    finally:
        checker.join()
    if problem:
        raise problem[0]
    if load_error is not None:
        raise DamagedCheckpoint(f"checkpoint {path}: refused to load state.pt "
                                f"({type(load_error).__name__}: {str(load_error).splitlines()[0]})") from load_error
    if not isinstance(state, dict) or "model" not in state:
        raise DamagedCheckpoint(f"checkpoint {path}: state.pt holds no run state")
    return state, meta


def read_config_yaml(path: Path) -> str:
    """The composed config a checkpoint was saved with (YAML text; empty if it has none)."""
    try:
        return (Path(path) / "config.yaml").read_text(encoding="utf-8")
    except OSError:
        return ""


def read_index(root: Path) -> dict | None:
    """``checkpoints/index.json``: ``checkpoints`` (names, oldest first) and, with ``keep_best``, ``best``
    (``name``, ``metric``, ``value``); ``None`` when missing or unreadable."""
    try:
        index = json.loads((root / INDEX).read_text(encoding="utf-8"))
        return index if isinstance(index, dict) and isinstance(index.get("checkpoints"), list) else None
    except (OSError, ValueError):
        return None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first: from the index, else from the directory names."""
    index = read_index(root)
    if index is not None:
        names = [n for n in index["checkpoints"] if isinstance(n, str)]
    else:
        names = sorted(p.name for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    return [root / n for n in names if (root / n).is_dir()]


def resume_candidates(target: Path) -> tuple[list[Path], bool]:
    """Checkpoints to try for ``checkpoint.resume=<target>``, newest first, and whether falling back to
    an older one is allowed: a checkpoint directory is that one alone; a ``checkpoints/`` directory or a
    run directory means its newest good checkpoint."""
    if (target / "meta.json").exists() or (target / "state.pt").exists():
        return [target], False
    root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
    return list(reversed(list_checkpoints(root))), True


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
        self.config_yaml: str | None = None  # the run's config as YAML, made at the first save
        self.reported: dict[str, int] = {}  # metric name -> the step it was last reported at

    def _root(self, run) -> Path:
        return run.output_dir / "checkpoints"

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        if not self.restore(run) and run.status == "validating":
            run.log.warning("validating_initial_weights", resume=run.config.checkpoint.resume,
                            fix="set checkpoint.resume=<a run directory or checkpoint> to evaluate trained weights")
        if run.rank == 0:
            self._name_best(run, (read_index(self._root(run)) or {}).get("best"))

    @hookimpl
    def on_log_metrics(self, metrics, step):
        for name in metrics:
            self.reported[name] = step

    def _best(self, run, root: Path, name: str) -> dict | None:
        """The best checkpoint after saving ``name``: it, if ``keep_best.monitor`` was reported at this
        step with a better value than the previous best, else the previous best (``None``: keep none)."""
        keep_best = run.stage_config.checkpoint.keep_best
        monitor = keep_best.monitor
        previous = (read_index(root) or {}).get("best")
        if not monitor:
            return None
        if not isinstance(previous, dict) or previous.get("metric") != monitor or not (root / previous["name"]).is_dir():
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
        root = self._root(run)
        if resume == "auto":
            candidates, fallback = list(reversed(list_checkpoints(root))), True
        else:
            candidates, fallback = resume_candidates(Path(resume))
            if not candidates:
                raise ConfigError(f"checkpoint.resume: no complete checkpoint in {resume}")
        for path in candidates:
            try:
                state, meta = read_checkpoint(path)
            except DamagedCheckpoint as e:
                if not fallback:
                    raise ConfigError(f"checkpoint.resume: {e}") from e
                run.log.warning("checkpoint_damaged", path=str(path), error=str(e),
                                action="falling back to the previous checkpoint")
                continue
            self._load(run, path, state, meta)
            return True
        if candidates:
            run.log.warning("no_good_checkpoint", directory=str(candidates[0].parent),
                            action="starting from scratch")
        return False

    def _load(self, run, path: Path, state: dict, meta: dict) -> None:
        problems = model_mismatch(run.model, state["model"])
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
        check_optimizer()  # the stage it was saved in is entered now
        run.metrics.update(meta.get("metrics") or {})
        run.hooks.on_checkpoint_load(run=run, state=meta.get("plugins") or {})
        self.saved_step = self.seen_step = run.global_step
        run.log.info("resumed", path=str(path), step=run.global_step, stage=run.stage)

    @hookimpl
    def on_train_start(self, run):
        self.seen_step = run.global_step  # a step ends when the global step moves past this
        _remove_stale(self._root(run))

    @hookimpl(trylast=True)
    def on_train_batch_end(self, run):
        every = run.stage_config.checkpoint.every_steps
        step = run.global_step
        if step == self.seen_step:  # not the last batch of a step
            return
        self.seen_step = step
        if run.stopping or (every and step % every == 0):
            self.save(run)

    @hookimpl
    def on_train_end(self, run):
        if run.stage_config.checkpoint.save_at_end and self.saved_step != run.global_step:
            self.save(run)

    def save(self, run) -> Path | None:
        """Write a checkpoint of ``run`` now (rank 0 only) and prune to ``keep_last``.

        Refuses (``NonFiniteLossError``) when the run has gone non-finite since the last log, so the last
        good checkpoint is never replaced by a non-finite state.
        """
        if run.rank != 0:
            return None
        run.check_finite()
        root = self._root(run)
        plugin_state: dict = {}
        run.hooks.on_checkpoint_save(run=run, state=plugin_state)
        try:
            json.dumps(plugin_state)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"on_checkpoint_save: plugin state must be JSON-able ({e}); keys: "
                              f"{', '.join(map(str, plugin_state))}") from e
        meta = {"global_step": run.global_step, "stage": run.stage, "plugins": plugin_state,
                "metrics": dict(run.metrics), "run_id": run.run_id, "optimizer": type(run.optimizer).__name__}
        if self.config_yaml is None:  # a plugin instance serves one run, whose config does not change
            self.config_yaml = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(run.config)))
        name = f"step-{run.global_step:08d}"
        path = write_checkpoint(root, name, run.state_dict(), meta, self.config_yaml)
        kept = [p.name for p in list_checkpoints(root) if p.name != name] + [name]
        retained = kept[-run.stage_config.checkpoint.keep_last:]
        best = self._best(run, root, name)
        index: dict = {"checkpoints": retained}
        if best:
            index["checkpoints"] = retained = sorted(set(retained) | {best["name"]})  # step-<zero-padded>
            index["best"] = best
        try:
            write_json_atomic(root / INDEX, index)
        except OSError as e:
            raise CheckpointWriteError(f"checkpoint: could not update {root / INDEX} ({e.strerror or e}); "
                                       f"{path} is complete and the previous checkpoints are intact") from e
        for old in kept:
            if old not in retained:
                shutil.rmtree(root / old, ignore_errors=True)
        self._name_best(run, best)
        self.saved_step = run.global_step
        run.log.info("checkpoint_saved", path=str(path))
        return path


def _remove_stale(root: Path) -> None:
    """Temporary directories left by a process killed while writing (never part of a checkpoint)."""
    if root.is_dir():
        for stale in list(root.glob(".tmp-*")) + list(root.glob(".old-*")) + list(root.glob(f"{INDEX}.tmp-*")):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

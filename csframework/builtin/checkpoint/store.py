"""The ``checkpoints/`` directory: which checkpoints it holds, its index, pruning, what
``checkpoint.resume`` names, and clean-up after a writer that died.

Checkpoint names come only from listing ``checkpoints/`` (real directories named ``step-<8 digits>``, not
links, lying inside it); ``checkpoints/index.json`` (the complete checkpoints, oldest first) is a hint
written last, checked against that listing and rebuilt when wrong; pruning deletes only such directories.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ...errors import CheckpointNotFound, ConfigError, UnreadableCheckpoints, UnsafePathError, clipped
from ...files import SafeDir
from ...jsonout import dumps
from .untrusted import read_json

INDEX = "index.json"
#: The names the framework gives checkpoint directories: ``step-`` and the global step, 8 digits or more.
NAME = re.compile(r"step-(?:\d{8}|[1-9]\d{8,})")
#: Temporary names the framework writes under: unpredictable (``SafeDir.private_dir``, ``SafeDir.atomic``).
_TEMPORARY = re.compile(r"\.(?:tmp|old)-step-\d+\.[0-9a-f]{16}|\.index\.json\.[0-9a-f]{16}\.tmp")
MAX_INDEX_BYTES = 1 << 20


def step_of(name: str) -> int:
    """The global step of checkpoint ``name`` (one ``NAME`` matches)."""
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
    return sorted(names, key=step_of)


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


def resolve_checkpoint_path(target: Path) -> tuple[Path, bool]:
    """What a user's path to a checkpoint names, resolved: ``(a checkpoint directory, False)``, or ``(a
    checkpoints/ directory, True)`` to choose among (for a run directory, its ``checkpoints/``).
    ``CheckpointNotFound`` naming the path and what it lacks when it is neither; ``UnsafePathError`` when a run
    directory's ``checkpoints`` is a link. The path itself is the user's (trusted, so resolved); what lies in it
    is not."""
    target = Path(os.path.realpath(target))
    try:
        exists, is_dir = target.exists(), target.is_dir()
    except OSError as e:  # a name too long, a directory that cannot be searched
        raise CheckpointNotFound(f"{clipped(target)}: cannot use it ({e.strerror or e}); give a checkpoint, "
                                 "checkpoints/ or run directory") from e
    if not exists:
        raise CheckpointNotFound(f"{clipped(target)} does not exist; give a checkpoint, checkpoints/ or run directory")
    if not is_dir:
        raise CheckpointNotFound(f"{clipped(target)} is not a csframework checkpoint: it is a file, and a checkpoint "
                                 "is a directory holding meta.json, state.pt and config.yaml; give a checkpoint, "
                                 "checkpoints/ or run directory")
    if (target / "meta.json").exists() or (target / "state.pt").exists():
        return target, False
    kind = SafeDir(target).kind("checkpoints")
    if kind == "dir":
        return target / "checkpoints", True
    if kind == "link":  # as in the run's own resume: never followed to another run's checkpoints
        raise UnsafePathError(f"{target / 'checkpoints'}: it is a symbolic link, which csframework never creates; "
                              "remove it, or name the checkpoints directory it points to")
    if not scan_checkpoints(target):
        raise CheckpointNotFound(f"{target} is not a csframework checkpoint: it holds no meta.json, no "
                                 "checkpoints/ and no step-NNNNNNNN/ checkpoint directories")
    return target, True


def resume_source(target: Path) -> tuple[Path, bool]:
    """What ``checkpoint.resume=<target>`` names (``resolve_checkpoint_path``): ``(a checkpoint directory, False)``, or
    ``(a checkpoints/ directory, True)`` whose newest good checkpoint is meant. ``ConfigError`` naming the
    path and what it lacks when it is neither."""
    try:
        return resolve_checkpoint_path(target)
    except CheckpointNotFound as e:
        raise ConfigError(f"checkpoint.resume: {e}") from e


def write_index(root: Path, index: dict) -> None:
    """Replace ``root/index.json`` atomically (written last, after the checkpoint it lists is complete)."""
    SafeDir(root).write(INDEX, dumps(index))


def remove_checkpoint(root: Path, name: str) -> None:
    """Delete one of the framework's checkpoint directories in ``root``; any other name is left alone
    (``SafeDir.remove``: the tree is walked by descriptor, no link in it followed)."""
    if name in scan_checkpoints(root):
        SafeDir(root).remove(name)


def remove_stale(root: Path) -> None:
    """Temporary directories and files left by a writer that died (never part of a checkpoint): only the
    names the framework writes under. Called while this run holds the run directory's lock."""
    checkpoints = SafeDir(root)
    for name in checkpoints.names():
        if _TEMPORARY.fullmatch(name):
            checkpoints.remove(name)

"""Checkpoints: the plugin that saves and resumes them, and the format and directory it uses.

- ``untrusted``: reading files from a run directory as untrusted data (bounded, through no link);
- ``format``: one checkpoint directory, written atomically and read back checked (sizes, CRC-32s, meta);
- ``store``: the ``checkpoints/`` directory (which checkpoints it holds, its index, pruning, resume paths);
- ``plugin``: ``CheckpointPlugin``, when to save, what to keep, how to resume.

``csframework.weights`` (``csf.load_checkpoint``) reads a run's weights back through ``format`` and ``store``.

Everything read from disk is data, never a path to obey (docs/durability.md, "Threat model"). This module
only re-exports the names the rest of csframework, its tests and benchmarks import from it.
"""
from __future__ import annotations

from ...errors import CheckpointWriteError, DamagedCheckpoint
from .format import (FORMAT, MAX_CONFIG_BYTES, MAX_META_BYTES, file_crc32, read_checkpoint, read_meta, temporary_dir,
                     write_checkpoint)
from .plugin import CheckpointPlugin
from .store import MAX_INDEX_BYTES, checkpoint_names, list_checkpoints, scan_checkpoints
from .untrusted import MAX_DEPTH

__all__ = ["FORMAT", "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_INDEX_BYTES", "MAX_META_BYTES", "CheckpointPlugin",
           "CheckpointWriteError", "DamagedCheckpoint", "checkpoint_names", "file_crc32", "list_checkpoints",
           "read_checkpoint", "read_meta", "scan_checkpoints", "temporary_dir", "write_checkpoint"]

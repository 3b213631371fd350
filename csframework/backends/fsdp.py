"""``backend.strategy=fsdp``: parameters, gradients and optimizer state sharded over the ranks with FSDP2
(``torch.distributed.fsdp.fully_shard``), and their checkpoints written by every rank with
``torch.distributed.checkpoint`` (DCP), no gather on rank 0.

Loading runs no code from the files: DCP's ``.metadata`` is a pickle, read here by an unpickler that knows
only DCP's metadata types (and the dtypes, sizes and paths in them); the non-tensor values of the state
(the optimizer's hyper-parameters) are read with ``torch.load(weights_only=True)`` where DCP would allow any
pickle; every file DCP reads must be one the checkpoint's own ``meta.json`` lists. DCP reshards on load, so
a checkpoint resumes with another number of ranks.
"""
from __future__ import annotations

import inspect
import io
import math
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

#: FSDP2 (``fully_shard``, ``torch.distributed.tensor``) is public from torch 2.6 on; on an older torch
#: (the Cerebras stack pins 2.4) ``strategy=fsdp`` is refused before launch (``backends.eager``), while the
#: checkpoint code here (DCP metadata reading) still imports.
FSDP2_TORCH = (2, 6)

def shard(model: torch.nn.Module, wrap: list[str], param_dtype: torch.dtype | None) -> torch.nn.Module:
    """Shard ``model`` in place: each sub-module whose class name is in ``wrap`` as its own unit (its
    parameters gathered only while it runs), then the rest at the root. ``param_dtype``: compute in that
    dtype with float32 master weights and gradient reduction (FSDP's ``MixedPrecisionPolicy``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for module in list(model.modules())[1:]:
        if type(module).__name__ in wrap:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor
    return to_local() if to_local is not None else tensor


def save(model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Every rank writes its shards of the model and optimizer state into ``directory`` (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load(model: torch.nn.Module, optimizer, directory: Path, files: set[str]) -> None:
    """Load the shards in ``directory`` into ``model`` and ``optimizer`` (collective; any number of ranks).
    ``files``: the names the checkpoint lists; DCP may read no other."""
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads into these very dicts (in place), which then go back into the model and optimizer
    dcp.load({"model": model_state, "optim": optim_state}, storage_reader=_SafeReader(directory, files),
             planner=_SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def read_model(directory: Path, files: set[str]) -> dict[str, Any]:
    """The whole model of the shards in ``directory``, consolidated in this process with no process group
    (``csf.load_checkpoint``): each tensor allocated at its full size from DCP's metadata, then filled by
    ``dcp.load`` through the same reader and planner as ``load`` (no code run, only the listed ``files``
    read). Metadata describing more tensor data than the shards hold, or a state of another shape, is
    refused before anything is allocated (``ValueError``)."""
    from torch.distributed.checkpoint._traverse import set_element

    metadata = _SafeReader(directory, files).read_metadata()
    entries = metadata.state_dict_metadata
    paths = metadata.planner_data or {}  # each flattened key's path in the state ``save`` wrote
    wanted: list[tuple[tuple, Any]] = []
    total = 0
    for key, item in entries.items():
        path = tuple(paths.get(key) or key.split(".", 1))
        if not path or path[0] != "model":  # the optimizer's state
            continue
        if len(path) < 2 or not all(type(p) is str or (type(p) is int and 0 <= p < len(entries)) for p in path):
            raise ValueError(f"its metadata holds {key!r} at {path!r}, which is no place in a model state dict")
        if isinstance(item, dcp_metadata.TensorStorageMetadata):
            if not all(type(n) is int and n >= 0 for n in item.size):  # (-1, -n) would cancel in the product
                raise ValueError(f"its metadata gives {key!r} the size {list(item.size)!r:.80}, which no tensor has")
            total += math.prod(item.size) * item.properties.dtype.itemsize
        wanted.append((path, item))
    held = sum(os.stat(directory / name, follow_symlinks=False).st_size for name in files)
    if total > held:
        raise ValueError(f"its metadata describes {total} bytes of model tensors, more than the {held} bytes "
                         "of its shards")
    state: dict = {"model": {}}
    for path, item in wanted:  # non-tensor values (a module's extra state) are read into their place
        set_element(state, path, torch.empty(item.size, dtype=item.properties.dtype)
                    if isinstance(item, dcp_metadata.TensorStorageMetadata) else None)
    reader, planner = _SafeReader(directory, files), _SafePlanner()
    with warnings.catch_warnings():  # DCP's notes on how it loads (a single process, a deprecated spelling)
        warnings.simplefilter("ignore")
        try:
            if "no_dist" in inspect.signature(dcp.load).parameters:
                dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
            else:  # an older torch (2.4): the same, under its older name
                dcp.load_state_dict(state, reader, no_dist=True, planner=planner)
        except CheckpointException as e:  # a BaseException wrapping what failed: say that instead
            failure = next(iter(e.failures.values()), None)
            cause = failure[0] if isinstance(failure, tuple) else failure
            raise ValueError(f"{type(cause).__name__}: {cause}" if cause is not None else str(e)) from e
    return state["model"]


# -- no code on load ------------------------------------------------------------------------------------
_METADATA_TYPES = {name for name, value in vars(dcp_metadata).items() if isinstance(value, type)}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: any other global is refused."""

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ and name in _METADATA_TYPES:
            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` at ``path``, unpickled with only DCP's metadata types allowed."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeReader(FileSystemReader):
    def __init__(self, path: Path, files: set[str]):
        super().__init__(str(path))
        self._files = files

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        metadata = read_metadata(Path(self.path) / ".metadata")
        for info in (metadata.storage_data or {}).values():
            if getattr(info, "relative_path", None) not in self._files:
                raise pickle.UnpicklingError(f"it points at {getattr(info, 'relative_path', info)!r}, a file "
                                             "the checkpoint does not list")
        metadata.storage_meta = dcp_metadata.StorageMeta(load_id=self.load_id)
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


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

import io
import pathlib
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
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
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, storage_reader=_SafeReader(directory, files), planner=_SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


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


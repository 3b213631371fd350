"""The input functions cstorch's DataLoader ships to the cluster's input workers (``backend.type=CSX``):
module-level functions of plain values (picklable with dill) that build csframework's own loaders there
(``csframework.data.build_loader``, the function the run's own loaders come from: every ``data`` setting
applies), so the workers read the batches csframework would (the same seeded order, from the same
position)."""
from __future__ import annotations

import itertools
from typing import Any, Iterator


def loader_args(run) -> tuple[dict, int, int, int]:
    """The arguments of ``input_fn`` for ``run``'s current position: the ``data`` section as plain values,
    the seed, the epoch and the batches of it already consumed."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(run.stage_config.data), resolve=True, enum_to_str=True)
    return data, run.stage_config.seed, run.epoch, run.batch_in_epoch


def data_config(data: dict) -> Any:
    """``loader_args``' plain ``data`` section as csframework's typed ``DataConfig`` again."""
    from omegaconf import OmegaConf

    from csframework.config import DataConfig

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), data))


def input_fn(data: dict, seed: int, epoch: int, start: int) -> Iterator[Any]:
    """csframework's training batches from batch ``start`` of ``epoch`` on, epoch after epoch (one
    process's share)."""
    from csframework.data import build_loader, epoch_batches

    loader, _ = build_loader(data_config(data), "train", seed, device_type="CSX")
    for e in itertools.count(epoch):
        yield from epoch_batches(loader, e, start if e == epoch else 0)


def val_input_fn(data: dict, seed: int) -> Any:
    """csframework's validation loader (``data.val``, in order, the last batch padded as csframework's own)."""
    from csframework.data import build_loader

    loader, _ = build_loader(data_config(data), "val", seed, device_type="CSX")
    return loader

"""The input functions cstorch's DataLoader ships to the cluster's input workers (``backend.type=CSX``):
module-level functions of plain values (picklable with dill) that build csframework's own loaders there, so
the workers read the batches csframework would (the same seeded order, from the same position)."""
from __future__ import annotations

import itertools
from typing import Any, Iterator


def loader_args(run) -> tuple[dict, int, int, int]:
    """The arguments of ``input_fn`` for ``run``'s current position: the ``data`` section as plain values,
    the seed, the epoch and the batches of it already consumed."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(run.stage_config.data), resolve=True, enum_to_str=True)
    return data, run.stage_config.seed, run.epoch, run.batch_in_epoch


def input_fn(data: dict, seed: int, epoch: int, start: int) -> Iterator[Any]:
    """csframework's training batches from batch ``start`` of ``epoch`` on, epoch after epoch (one
    process's share)."""
    from csframework.data import build_collate, epoch_batches, make_loader
    from csframework.targets import build

    train = build(data["train"], "data.train")
    loader = make_loader(train, data["batch_size"], shuffle=data["shuffle"], drop_last=data["drop_last"], seed=seed,
                         num_workers=0, collate_fn=build_collate(data.get("collate_fn")),
                         batched_fetch=data.get("batched_fetch", True), role="data.train")
    for e in itertools.count(epoch):
        yield from epoch_batches(loader, e, start if e == epoch else 0)


def val_input_fn(data: dict, seed: int) -> Any:
    """csframework's validation loader (``data.val``, in order, the last batch padded as csframework's own)."""
    from csframework.data import build_collate, make_loader
    from csframework.targets import build

    val = build(data["val"], "data.val")
    return make_loader(val, data.get("eval_batch_size") or data["batch_size"], shuffle=False, drop_last=False,
                       seed=seed, num_workers=0, collate_fn=build_collate(data.get("collate_fn")), pad=True,
                       batched_fetch=data.get("batched_fetch", True), role="data.val")

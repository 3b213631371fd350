"""The process group of a run under ``torchrun`` (one node or many, elastic restarts included).

Ranks, world size and the rendezvous address come from the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``); this
module only adds two things to ``torch.distributed.init_process_group``:

- every collective (and the start-up rendezvous) is bounded by ``backend.timeout_s``: a rank that died or
  stopped answering (SIGSTOP, a hung node) makes the others fail with torch's error instead of waiting
  forever; torchrun then ends (or, with ``--max-restarts``, restarts) the whole group;
- the rendezvous store is keyed by the restart count: after an elastic restart the new group reads none of
  the keys (the dead workers' addresses) the previous group left in torchrun's store, which otherwise makes
  gloo connect to a dead rank or hang.
"""
from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist

from ..errors import CsfError, RankLostError

#: ``backend.timeout_s`` when not set: long enough for a slow checkpoint or evaluation on one rank.
DEFAULT_TIMEOUT_S = 600.0


def timeout(timeout_s: float | None) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)


def init_process_group(backend: str, timeout_s: float | None) -> None:
    """Join the group torchrun describes in the environment, every collective bounded by ``timeout_s``."""
    limit = timeout(timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=limit))
    store.set_timeout(limit)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"csframework/restart-{restart}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit)


#: What torch's collectives say when a peer is gone (gloo, NCCL, the TCP store) rather than a model's bug.
_LOST = re.compile(r"pair closure|closed by peer|connection reset|broken pipe|timed? ?out|timeout|"
                   r"socket|nccl|gloo", re.IGNORECASE)


def peer_lost(error: BaseException, rank: int, timeout_s: float | None) -> RankLostError | None:
    """The error to report when ``error`` (raised in a distributed run) is torch's word that another rank
    died or stopped answering, else ``None``."""
    if isinstance(error, CsfError) or not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = " ".join(str(error).split())
    if not (isinstance(error, dist.DistError) or _LOST.search(text)):
        return None
    return RankLostError(f"rank {rank}: another rank died or stopped answering within backend.timeout_s="
                         f"{timeout_s or DEFAULT_TIMEOUT_S:g} ({type(error).__name__}: {text[:300]}); the last "
                         "complete checkpoint is intact: continue with checkpoint.resume=auto")


def all_ranks_agree(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on every rank (one small all-reduce; ``group``: a gloo group beside NCCL)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def distribution(strategy: object, world_size: int) -> dict[str, object]:
    """Under torchrun (a process group exists): ``world_size``, ``strategy`` (``ddp``, ``fsdp``: the stage's
    ``backend.strategy``) and ``process_group`` (its backend: ``gloo``, ``nccl``), which the start line and
    ``summary.json`` show; empty in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    return {"world_size": world_size, "strategy": getattr(strategy, "value", strategy),
            "process_group": str(dist.get_backend())}

"""Ending a torchrun rank after the CLI's work: every rank at a barrier, then ``os._exit``."""
from __future__ import annotations

import os
import sys

from ..errors import ExitCode


def leave_process_group(status) -> None:
    """Under torchrun, end this rank here: wait for every rank at a barrier (a completed run's ranks all get
    here), destroy the process group and leave with ``os._exit``. Left to interpreter finalisation, gloo's
    threads can outlive the objects that own them and abort a completed rank ("terminate called without an
    active exception", SIGABRT), so torchrun would report a completed run as failed. Everything csframework
    writes is closed and fsynced by now; stdio and logging are flushed first."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import logging

    code = status if isinstance(status, int) else ExitCode.OK if status is None else ExitCode.FAILED
    try:
        if code == ExitCode.OK:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer is gone: nothing left to agree on; leave all the same
        pass
    if isinstance(status, str):
        sys.stderr.write(status + "\n")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

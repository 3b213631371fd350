"""Process-wide state a run may change, saved and restored in one place (``clean_process_state``).

A multirun job that runs in the same process as other jobs (Hydra's basic launcher, a reused joblib worker,
a Ray worker) must leave the process as it found it, so every job gives the result it gives alone: torch
threads, default dtype, float32 matmul precision, deterministic-algorithm flags, every random generator,
the logging configuration and the backends alive under the one-device-type rule of ``csf.backend``.
"""
from __future__ import annotations

import contextlib
import logging
import sys

import torch

from .rng import rng_state, set_rng_state

LOWLEVEL = "csframework.backends.csx.lowlevel"  # csf.backend's registry; looked at only if a job imported it


def _logging_state() -> dict:
    loggers = {"": logging.getLogger()}
    loggers.update((name, logger) for name, logger in logging.Logger.manager.loggerDict.items()
                   if isinstance(logger, logging.Logger))
    return {name: (logger, list(logger.handlers), logger.level, logger.propagate, logger.disabled)
            for name, logger in loggers.items()}


def _restore_logging(saved: dict) -> None:
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and name not in saved:
            logger.handlers.clear()  # a logger the job created: no handler of the job survives it
    for logger, handlers, level, propagate, disabled in saved.values():
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled


@contextlib.contextmanager
def clean_process_state():
    """Run the body, then put back everything process-wide it may have changed (see the module doc)."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    matmul = torch.get_float32_matmul_precision()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    rng, logs = rng_state(), _logging_state()
    lowlevel = sys.modules.get(LOWLEVEL)
    backends, current = (set(lowlevel._LIVE), lowlevel._CURRENT) if lowlevel else (set(), None)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(matmul)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        set_rng_state(rng)
        _restore_logging(logs)
        lowlevel = sys.modules.get(LOWLEVEL)
        if lowlevel is not None:
            for made in set(lowlevel._LIVE) - backends:  # the job's backends: another device type may follow
                lowlevel._LIVE.discard(made)
            lowlevel._CURRENT = current

"""The random generators a run uses (Python, NumPy, torch, CUDA): seeding and their exact state."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (torch seeds CUDA too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_batch(seed: int, size: int, first_tagged: int) -> None:
    """Seed every generator for the batch a loader worker is about to read, from the run's ``seed``, the
    epoch and the batch's first sample: ``first_tagged`` is that sample's index tagged as
    ``epoch * size + index`` (``data.ResumableSampler`` with ``tag_epoch``)."""
    epoch, first = divmod(first_tagged, size)
    seed_everything(((seed * 1_000_003 + epoch) * 1_000_003 + first) % 2**63)


def rng_state() -> dict[str, Any]:
    """The state of every generator, as tensors and plain values (``torch.load(weights_only=True)``)."""
    numpy_state: Any = np.random.get_state()  # the legacy tuple (legacy=True); numpy types it tuple | dict
    state: dict[str, Any] = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(numpy_state[1].astype(np.int64)),
             "numpy_pos": int(numpy_state[2]), "numpy_gauss": [int(numpy_state[3]), float(numpy_state[4])],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    has_gauss, gauss = state.get("numpy_gauss", (0, 0.0))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

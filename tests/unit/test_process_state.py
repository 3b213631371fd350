"""``csframework.process_state.clean_process_state``: what a job changes process-wide is put back when it ends."""
import logging
import random

import torch

import csframework as csf
from csframework.process_state import clean_process_state


def test_clean_process_state_restores_what_a_job_changes():
    threads, draw = torch.get_num_threads(), (random.getstate(), torch.get_rng_state())
    handlers = list(logging.getLogger().handlers)
    with clean_process_state():
        torch.set_num_threads(1 if threads > 1 else 2)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(123), random.seed(123), random.random()
        logging.getLogger().addHandler(logging.NullHandler())
        csx = csf.backend("CSX")
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == torch.float32
    assert not torch.are_deterministic_algorithms_enabled()
    assert (random.getstate(), torch.get_rng_state().tolist()) == (draw[0], draw[1].tolist())
    assert logging.getLogger().handlers == handlers
    assert csf.backend("CPU") is not None  # the job's CSX backend no longer holds the process
    del csx

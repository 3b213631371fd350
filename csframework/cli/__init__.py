"""The command line's parts (``python -m csframework`` is ``csframework.__main__``): the one task function of
Hydra's ``@hydra.main`` (``job``), the single run's directory callback (``run_dir``), the one-line error
report (``report``) and leaving a torchrun process group (``process_group``)."""

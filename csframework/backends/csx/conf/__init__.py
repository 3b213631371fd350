"""Hydra config files of the CSX backend (``device/csx.yaml``, ``backend/csx.yaml``), on the search path through the CSX plugin."""

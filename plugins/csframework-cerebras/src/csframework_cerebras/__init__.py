"""csframework-cerebras: ``backend=cerebras`` runs a csframework run through the real Cerebras stack,
``cerebras-pytorch`` (cstorch). Importing the package does not import cstorch: the backend is built only
when a run chooses it (``backend.py``)."""

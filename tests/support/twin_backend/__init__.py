"""A named backend for the tests: ``backend=twin`` runs device type CPU beside the built-in eager backend,
with a ``type`` setting of its own (``A`` or ``B``), as ``backend=cerebras`` runs CSX beside the emulator."""

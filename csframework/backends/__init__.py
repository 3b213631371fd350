"""Backends execute a run's steps on one device type; each is supplied by a plugin through the
``csframework_backend`` hook (``base.BackendSpec``): ``eager`` (CPU/GPU) and ``csx/`` (the CSX emulator) are
the built-in ones. ``base`` declares what the loop calls (``Backend``)."""

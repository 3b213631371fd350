"""The CSX low-level API for custom training loops, mirroring ``cerebras.pytorch``::

    import csframework as csf

    backend = csf.csx.backend("CSX", retrace_every_iteration=False)
    model = csf.csx.compile(model, backend)

    @csf.csx.trace
    def training_step(inputs, targets): ...

See ``csframework.backends.csx.lowlevel``. Importing this module imports the tracer.
"""
from .backends.csx.lowlevel import backend, compile, step_closure, trace  # noqa: A004 - mirrors cstorch

__all__ = ["backend", "compile", "trace", "step_closure"]

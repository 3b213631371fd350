"""Static graphs of a training step, for any device that runs one: the tracer (``tracer``: capture with
make_fx, guards, state swapping, step closures), ``StaticStep`` and the compile cache (``compiler``), the
graph's canonical form, fingerprint and report (``passes``), its compilation to host code with TorchInductor
(``inductor``), the traceable optimizers (``optim``), loss scaling inside the graph (``precision``), the
tracing errors that name the user's line (``errors``) and the trust rule of compile caches (``cachedir``).

The CSX emulator (``backends/csx``) and the compile path of the CPU/GPU backend (``backends/compile``) use
it; it imports neither. Nothing is imported here, so ``import csframework`` does not import the tracer.
"""

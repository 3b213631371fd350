"""The CSX emulator: ``device=csx`` traces the step into a static graph once and executes that graph every
iteration on the host (CPU, or CUDA when present), with Cerebras' static-graph, tracing and precision rules.

Modules: ``tracer`` (capture with make_fx, guards, state swapping, step closures), ``compiler`` (compile
passes, compile cache, ``StaticStep``), ``graph`` (canonical form, fingerprint, compile report), ``optim``
(traceable built-in optimizers), ``precision`` (cbfloat16 compute, in-graph loss scaling), ``cbfloat16``
(the CB16 number format), ``backend`` (``CsxBackend`` for ``Run``). See docs/csx.md.
"""
from .backend import CsxBackend

__all__ = ["CsxBackend"]

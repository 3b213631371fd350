"""``backend.compile=true``: the CPU/GPU backend's step and evaluation compiled, with the whole step as one
graph where it can be (``whole_step``, on ``csframework.graph``) and its functions compiled with
``torch.compile`` otherwise (``step``); ``scope`` holds the process-wide torch settings compiling needs.

The CPU/GPU backend imports these modules only when a run compiles (``EagerBackend.attach``): an eager run
imports none of them, nor the static-graph tracer they use (start-up, issue 50 item 1). Here is only what the
backend's config check needs.
"""

#: ``backend.compile_mode``'s values (``torch.compile``'s modes).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

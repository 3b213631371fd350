"""The CSX emulator: ``device=csx`` traces the step into a static graph once and executes that graph every
iteration on the host (CPU, or CUDA when present), with Cerebras' static-graph, tracing and precision rules.

Modules: ``plugin`` (the built-in ``csx`` plugin: device type, schema, rules, config files), ``schema``
(``backend.*`` settings and validation rules), ``backend`` (``CsxBackend`` for ``Run``), ``lowlevel``
(``csframework.csx``: backend/compile/trace/step_closure for custom loops), ``tracer`` (capture with make_fx,
guards, state swapping, step closures), ``compiler`` (compile passes, compile cache, ``StaticStep``),
``graph`` (canonical form, fingerprint, compile report), ``optim`` (traceable built-in optimizers),
``precision`` (cbfloat16 compute, in-graph loss scaling), ``cbfloat16`` (the CB16 number format),
``errors`` (tracing errors naming the user's line), ``conf/`` (``device/csx.yaml``, ``backend/csx.yaml``).
See docs/csx.md. Nothing is imported here, so the plugin loads without the tracer.
"""

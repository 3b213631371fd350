"""The CSX emulator: ``device=csx`` traces the step into a static graph once and executes that graph every
iteration on the host (CPU, or CUDA when present), with Cerebras' static-graph, tracing and precision rules.

Modules: ``plugin`` (the built-in ``csx`` plugin: device type, schema, rules, config files), ``schema``
(``backend.*`` settings and validation rules), ``backend`` (``CsxBackend`` for ``Run``), ``lowlevel``
(``csf.backend``/``compile``/``trace``/``step_closure`` for custom loops), ``precision`` (cbfloat16 compute on
top of the graph's precision), ``cbfloat16`` (the CB16 number format), ``conf/`` (``device/csx.yaml``,
``backend/csx.yaml``). The static-graph machinery it drives (tracer, ``StaticStep``, compile cache, Inductor,
traceable optimizers, in-graph loss scaling) is ``csframework.graph``. See docs/guides/csx.md. Nothing is imported
here, so the plugin loads without the tracer.
"""

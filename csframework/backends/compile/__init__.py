"""``backend.compile=true``: the CPU/GPU backend's step and evaluation compiled, with the whole step as one
graph where it can be (``whole_step``, on ``csframework.graph``) and its functions compiled with
``torch.compile`` otherwise (``step``); ``scope`` holds the process-wide torch settings compiling needs."""

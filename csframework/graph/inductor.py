"""Compile a traced step's static graph to host code with TorchInductor (``backend.graph_compiler=inductor``).

The graph is compiled once, ahead of the first execution, with ``torch._inductor.standalone_compile``: every
operation, the in-place updates of parameters and optimizer state included, becomes C++ loops or aten calls
(Inductor functionalises the graph and writes the mutated inputs back, so the live tensors are updated as by
the interpreted graph). The artifact is saved in the compile cache entry of the graph's fingerprint, and
Inductor's own cache (the C++ kernels) lives under ``<compile_dir>/inductor``; an identical graph in a later
run loads the artifact instead of compiling.

When compilation is not possible (no C++ compiler, an Inductor failure) ``compile_graph`` returns the reason
and the caller runs the interpreted graph: the numbers are then those of the eager kernels.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..compat import needs_torch
from ..errors import CsfError
from ..privatedir import PrivateDir

#: The first torch with ``torch._inductor.standalone_compile`` and ``CompiledArtifact``.
STANDALONE_TORCH = (2, 8)

#: Compilations done in this process (a cache hit loads and does not count): what tests count.
compilations = 0


def _host_tag() -> str:
    """What the kernels were built for: the CPU's vector ISA (a cache shared by machines of other CPUs never
    loads kernels they cannot run) and torch's thread count (Inductor's CPU kernels are specialised on it), or
    the CUDA version."""
    if torch.cuda.is_available():
        return "cuda" + str(torch.version.cuda).replace(".", "")
    return f"{torch.backends.cpu.get_cpu_capability().lower()}-t{torch.get_num_threads()}"


#: Inductor settings of every compilation: random operations draw from torch's generator (as the interpreted
#: graph's do), and a reduction is computed once into its own buffer, even a small one (``optim._once``).
BASE_PATCHES = {"fallback_random": True, "unroll_reductions_threshold": 1}


def artifact_name(config_patches: dict) -> str:
    """The file name, in the graph's cache entry, of its artifact built here with ``config_patches`` by this
    torch: a graph compiled with other Inductor settings (another ``backend.compile_mode``, another
    csframework's) or by another torch is another file, never loaded in its place."""
    settings = json.dumps([torch.__version__, sorted(config_patches.items())], default=repr)
    return f"inductor-{_host_tag()}-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.bin"


#: The largest artifact read back from a cache entry.
MAX_ARTIFACT_BYTES = 1 << 30


def _load_artifact(entry: PrivateDir, name: str):
    """The artifact ``name`` of ``entry`` (read through the no-follow layer: the user's own regular file), or
    None when absent. Inductor loads artifacts from a path only: the bytes go through a private copy."""
    try:
        data = entry.read(name, MAX_ARTIFACT_BYTES)
    except (OSError, ValueError, CsfError):
        return None
    import torch._inductor
    import torch._inductor.config as inductor_config

    with tempfile.TemporaryDirectory(prefix="csframework-artifact-") as private:
        path = os.path.join(private, name)
        with open(path, "xb") as f:
            f.write(data)
        # the artifact was built (and its vector ISA probed) on a CPU of this ISA: skip the probe, which builds
        # and loads test programs in subprocesses (seconds)
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            return torch._inductor.CompiledArtifact.load(path=path, format="binary")


def _save_artifact(artifact, entry: PrivateDir, name: str) -> None:
    """Save ``artifact`` as ``name`` in ``entry``, atomically, through the no-follow layer."""
    with tempfile.TemporaryDirectory(prefix="csframework-artifact-") as private:
        path = os.path.join(private, name)
        artifact.save(path=path, format="binary")
        with open(path, "rb") as f:
            entry.sub().write(name, f.read(), durable=False)


def example_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Uninitialised tensors with the placeholders' shapes, strides and dtypes (compilation reads no values)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        out.append(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                       device=val.device if val.device.type != "meta" else "cpu"))
    return out


@contextlib.contextmanager
def _inductor_cache(directory: Path):
    """Inductor's cache (generated code, built kernels) in ``directory`` for the duration; Inductor's default
    cache when ``directory`` cannot be created (a read-only compile cache must not stop training)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    try:
        PrivateDir(directory).sub()
    except (OSError, CsfError):
        yield
        return
    with temporary_cache_dir(str(directory)):
        yield


def compile_graph(gm: torch.fx.GraphModule, entry: PrivateDir | None, cache_root: Path | None,
                  config_patches: dict | None = None) -> tuple[Callable | None, dict]:
    """Compile ``gm`` (or load its artifact from ``entry``); returns ``(callable or None, info)``.

    ``info`` has ``status`` (``compiled``, ``loaded`` or ``fallback``), ``seconds`` and, on fallback,
    ``reason`` (one line). ``entry`` is the compile cache entry of the graph's fingerprint, ``cache_root``
    the compile cache directory (Inductor's cache goes under it); ``None`` for both compiles uncached.
    ``config_patches``: Inductor settings of this compilation (``backend.compile_mode``'s), on top of those here.
    """
    global compilations
    start = time.perf_counter()
    too_old = needs_torch("backend.graph_compiler=inductor (torch._inductor.standalone_compile)", STANDALONE_TORCH)
    if too_old:  # the Cerebras stack pins torch 2.4: the interpreted graph runs, with this one-line reason
        return None, {"status": "fallback", "seconds": 0.0, "reason": too_old}
    patches = {**BASE_PATCHES, **(config_patches or {})}
    name = artifact_name(patches)
    try:
        import torch._inductor

        cache = _inductor_cache(cache_root / "inductor") if cache_root is not None else contextlib.nullcontext()
        with cache, torch.no_grad():
            if entry is not None:
                try:
                    fn = _load_artifact(entry, name)
                    if fn is not None:
                        return fn, {"status": "loaded", "seconds": round(time.perf_counter() - start, 3)}
                except Exception:  # a stale or damaged artifact: compile again
                    pass
            inputs: list = example_inputs(gm)
            artifact = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_example_inputs",
                                                          options={"config_patches": patches})
            compilations += 1
            if entry is not None:
                try:
                    _save_artifact(artifact, entry, name)
                except Exception:  # a read-only or unserialisable cache must not stop training
                    pass
        return artifact, {"status": "compiled", "seconds": round(time.perf_counter() - start, 3)}
    except Exception as e:  # no C++ compiler, an unsupported operation, an Inductor bug: run interpreted
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        return None, {"status": "fallback", "seconds": round(time.perf_counter() - start, 3),
                      "reason": reason if len(reason) <= 300 else reason[:297] + "..."}

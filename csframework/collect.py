"""The output collector (``loop.collect``): the named evaluation outputs of every step and every rank,
concatenated on dim 0 in dataset order, each sample once, for ``on_eval_end`` hooks (``run.eval_outputs``).

Each rank keeps its own rows (CPU tensors; one row per sample) and, past ``loop.collect_max_memory_mb``,
appends them to spill files in the run directory instead. At the end of the evaluation rank 0 gathers the
ranks' rows chunk by chunk (each chunk within the memory bound) and interleaves them: row ``i`` of rank
``r`` is sample ``i * world_size + r`` of the padded evaluation order (``data.ResumableSampler``), so the
padding is the tail, cut at the dataset's size. A result that does not fit the bound is written to a file
and returned memory-mapped. ``cleanup`` removes every file once the hooks have run.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConfigError
from .files import SafeDir

MB = 2**20


class Collector:
    """Collects ``keys`` of the evaluation outputs of ``run`` (``add`` per batch, ``finish`` at the end)."""

    def __init__(self, run, keys, max_memory_mb: float):
        self.keys = list(keys)
        self.limit = max(1, int(max_memory_mb * MB))
        self.rank, self.world_size = run.rank, run.world_size
        self.group = run.backend.host_group  # gloo beside NCCL: gathers stay on the host
        # the samples to keep (the rest is padding): a pass's (loop.eval_steps draws a sample of the set); an
        # iterable dataset is not padded: keep every row
        self.size = getattr(getattr(run.val_loader, "position", None), "count", None)
        if self.size is None and hasattr(run.val_loader.dataset, "__len__"):
            self.size = len(run.val_loader.dataset)
        self.run_dir: SafeDir = run.files
        self.spill_dir: SafeDir | None = None  # made on the first spill: private, unpredictably named
        self.parts: dict[str, list[torch.Tensor]] = {k: [] for k in self.keys}
        self.rows = dict.fromkeys(self.keys, 0)
        self.layout: dict[str, tuple[tuple, torch.dtype]] = {}  # key -> (shape of a row, dtype)
        self.spilled = False
        self.held = 0  # bytes of tensors held in memory now
        self.peak = 0  # the most held at once

    # -- per batch --------------------------------------------------------------------------------------
    def add(self, outputs: dict, samples: int | None = None) -> None:
        """Keep the batch's rows of every key; ``samples``: the batch's sample count, which every key's rows
        must match (``None``: unknown, not checked)."""
        missing = [k for k in self.keys if k not in outputs]
        if missing:
            raise ConfigError(f"loop.collect: the model's evaluation outputs have no {missing[0]!r} (it returns "
                              f"{', '.join(sorted(outputs))}); remove it from loop.collect or return it from "
                              "forward(batch)")
        for key in self.keys:
            value = outputs[key]
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                raise ConfigError(f"loop.collect: output {key!r} is {_describe(value)}; only tensors with one "
                                  "row per sample can be collected (scalars are averaged into val/* metrics)")
            if samples is not None and len(value) != samples:
                raise ConfigError(f"loop.collect: output {key!r} has {len(value)} rows for a batch of {samples} "
                                  "samples; only outputs with one row per sample can be collected: return it "
                                  "per sample, or remove it from loop.collect")
            value = value.detach().to("cpu").contiguous()
            layout = (tuple(value.shape[1:]), value.dtype)
            if self.layout.setdefault(key, layout) != layout:
                raise ConfigError(f"loop.collect: output {key!r} changed from rows of shape "
                                  f"{list(self.layout[key][0])} {self.layout[key][1]} to {list(layout[0])} "
                                  f"{layout[1]} between batches; every batch must return the same row layout")
            self.parts[key].append(value)
            self.rows[key] += len(value)
            self._hold(value.nbytes)
        if self.held > self.limit:
            self._spill()

    def _hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _spill(self) -> None:
        """Append every key's rows held in memory to its spill file (in a directory of this collector's
        own, mode 0700 with a random name: nothing planted in the run directory is written through)."""
        if self.spill_dir is None:
            self.spill_dir = self.run_dir.private_dir(f"collect-rank{self.rank}")
        for key, parts in self.parts.items():
            with open(self._path(key), "ab") as f:
                for part in parts:
                    f.write(part.reshape(-1).view(torch.uint8).numpy().data)
            parts.clear()
        self.spilled, self.held = True, 0

    def _path(self, key: str, what: str = "rows") -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"{what}-{self.keys.index(key)}.bin"

    def _local(self, key: str) -> torch.Tensor:
        """This rank's rows of ``key``: in memory, or memory-mapped from its spill file."""
        shape, dtype = self.layout[key]
        if not self.spilled:
            joined = torch.cat(self.parts[key])
            self._hold(joined.nbytes)
            return joined
        return _mapped(self._path(key), (self.rows[key], *shape), dtype, shared=False)

    # -- at the end -------------------------------------------------------------------------------------
    def finish(self) -> dict[str, torch.Tensor]:
        """The collected outputs: complete on rank 0, ``{}`` on the other ranks (they only send)."""
        # joining the parts copies them, and rank 0 assembles every rank's rows: spill unless all that fits
        need = self.held * (2 + (self.world_size if self.rank == 0 and self.world_size > 1 else 0))
        if self.spilled or need > self.limit:
            self._spill()
        results = {}
        for key in self.keys:
            if key not in self.layout:  # no evaluation batch ran
                results[key] = torch.empty(0)
                continue
            if self.world_size == 1:
                local = self._local(key)
                self.parts[key].clear()
                results[key] = local
                continue
            result = self._gather(key)
            if result is not None:
                results[key] = result
        self.held = 0
        return results

    def _gather(self, key: str) -> torch.Tensor | None:
        """Rank 0: every rank's rows of ``key`` interleaved into dataset order, padding cut off."""
        import torch.distributed as dist

        shape, dtype = self.layout[key]
        local = self._local(key)
        self.parts[key].clear()
        rows, ws = self.rows[key], self.world_size  # every rank evaluated the same number of samples
        total = rows * ws if self.size is None else min(self.size, rows * ws)
        row_bytes = max(1, local[:1].nbytes)
        if self.rank == 0:
            if self.spilled:
                result = _mapped(self._path(key, "result"), (total, *shape), dtype, shared=True)
            else:
                result = torch.empty((total, *shape), dtype=dtype)
                self._hold(result.nbytes)
        chunk = max(1, self.limit // (2 * ws * row_bytes))  # rows per rank per gather
        for start in range(0, rows, chunk):
            piece = local[start:start + chunk].contiguous()
            pieces = [torch.empty_like(piece) for _ in range(ws)] if self.rank == 0 else None
            dist.gather(piece, pieces, dst=0, group=self.group)
            if pieces is not None:  # rank 0
                self.peak = max(self.peak, self.held + piece.nbytes * (ws + 1))
                at, end = start * ws, min(total, (start + len(piece)) * ws)
                if end > at:
                    result[at:end] = torch.stack(pieces, 1).flatten(0, 1)[:end - at]
        return result if self.rank == 0 else None

    def save(self, outputs: dict[str, torch.Tensor], name: str) -> Path:
        """Write ``outputs`` as safetensors file ``name`` in the run directory's ``eval_outputs/`` (a real
        directory; the file written atomically: complete or absent); returns its path."""
        from safetensors.torch import save

        return self.run_dir.sub("eval_outputs").write(name, save({k: v.contiguous() for k, v in outputs.items()}))

    def cleanup(self) -> None:
        """Remove the spill files (the memory-mapped tensors stay readable until dropped)."""
        self.parts = {k: [] for k in self.keys}
        if self.spill_dir is not None:
            self.run_dir.remove(self.spill_dir.parts[-1])
            self.spill_dir = None


def _mapped(path: Path, shape: tuple, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """A tensor of ``shape`` memory-mapped from ``path`` (``shared``: created, writes go to the file)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=shared, size=numel, dtype=dtype).view(shape)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a scalar tensor"
    return f"a {type(value).__name__}, not a tensor"

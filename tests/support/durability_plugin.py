"""Helpers for the durability tests (importable as ``durability_plugin``; CLI runs put tests/ on PYTHONPATH).

``Killer`` (``plugins.enable=[durability_plugin:Killer]``) sends a signal to its own process at one point
of a run chosen by the environment, so a test can kill a run deterministically anywhere:

    CSF_TEST_KILL=<point>@<global step>    e.g. after_backward@4, state_write@15, before_index@18
    CSF_TEST_SIGNAL=KILL|TERM|INT          (default KILL); TERM2 / INT2 send the signal twice
    CSF_TEST_SECOND_AT=<point>@<step>      with TERM/INT: send the second signal there instead
    CSF_TEST_KILL_RANK=<rank>              under DDP: only that rank signals itself (default: every rank)
    CSF_TEST_KILL_ATTEMPT=<n>              under torchrun --max-restarts: only in attempt n (0: the first)

Points are hooks (batch_start, after_backward, before_optimizer_step, batch_end, epoch_end, eval, log,
checkpoint_save, train_end; ``<step>`` is ``run.global_step`` when the hook runs) and moments inside a
checkpoint write (state_write: half of state.pt is on disk; before_commit: the temporary directory is
complete; before_index: the checkpoint is in place, the index not yet updated).
"""
from __future__ import annotations

import os
import signal

import torch
from torch import nn

import csframework as csf
from csframework.builtin import checkpoint as ckpt
from csframework.models import Supervised

import fixtures


def _parse(value: str | None):
    if not value:
        return None
    point, _, step = value.partition("@")
    return point, int(step)


class Killer:
    name = "killer"

    def __init__(self):
        self.target = _parse(os.environ.get("CSF_TEST_KILL"))
        self.second = _parse(os.environ.get("CSF_TEST_SECOND_AT"))
        kind = os.environ.get("CSF_TEST_SIGNAL", "KILL")
        self.twice = kind.endswith("2")
        self.signum = getattr(signal, "SIG" + kind.rstrip("2"))
        self.fired = False
        self.run = None
        rank = os.environ.get("CSF_TEST_KILL_RANK")
        if rank is not None and rank != os.environ.get("RANK", "0"):
            self.target = None
        attempt = os.environ.get("CSF_TEST_KILL_ATTEMPT")
        if attempt is not None and attempt != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
            self.target = None

    def hit(self, point: str, step: int) -> None:
        if not self.fired and (point, step) == self.target:
            self.fired = True
            os.kill(os.getpid(), self.signum)
            if self.twice:
                os.kill(os.getpid(), self.signum)
        elif self.fired and self.second is not None and (point, step) == self.second:
            os.kill(os.getpid(), self.signum)

    # -- hooks ------------------------------------------------------------------------------------------
    @csf.hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        self.run = run
        if self.target is None:
            return
        killer = self

        # patched where they are looked up: the format writes files and commits, the store writes the index
        original_write_file, original_commit = ckpt.format._write_file, ckpt.format._commit
        original_index = ckpt.store.write_index

        def write_file(where, name, write, **kwargs):
            if name != "state.pt" or ("state_write", run.global_step) != killer.target:
                return original_write_file(where, name, write, **kwargs)

            def half(f):  # write half of the state, make it durable, then die
                import io

                buf = io.BytesIO()
                write(buf)
                data = buf.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.f.fileno())
                killer.hit("state_write", run.global_step)

            return original_write_file(where, name, half, **kwargs)

        def commit(root, tmp, final):
            killer.hit("before_commit", run.global_step)
            return original_commit(root, tmp, final)

        def write_index(root, index):
            killer.hit("before_index", run.global_step)
            return original_index(root, index)

        ckpt.format._write_file, ckpt.format._commit, ckpt.store.write_index = write_file, commit, write_index

    @csf.hookimpl
    def on_train_batch_start(self, run):
        self.hit("batch_start", run.global_step)

    @csf.hookimpl
    def on_after_backward(self, run):
        self.hit("after_backward", run.global_step)

    @csf.hookimpl
    def on_before_optimizer_step(self, run):
        self.hit("before_optimizer_step", run.global_step)

    @csf.hookimpl
    def on_train_batch_end(self, run):
        self.hit("batch_end", run.global_step)

    @csf.hookimpl
    def on_train_epoch_end(self, run):
        self.hit("epoch_end", run.global_step)

    @csf.hookimpl
    def on_eval_batch_start(self, run):
        self.hit("eval", run.global_step)

    @csf.hookimpl
    def on_log_metrics(self, run, step):
        self.hit("log", step)

    @csf.hookimpl
    def on_checkpoint_save(self, run, state):
        state["killer"] = {"saved_at": run.global_step}
        self.hit("checkpoint_save", run.global_step)

    @csf.hookimpl(tryfirst=True)  # before the checkpoint plugin's end-of-stage save
    def on_train_end(self, run):
        self.hit("train_end", run.global_step)


class NoisyBlobs(fixtures.Blobs):
    """Blobs with random augmentation in ``__getitem__`` (uses torch's generator in whichever process
    loads the sample), so resume must restore data-loader worker randomness too."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.3 * torch.randn_like(x), y


class NanAt(nn.Module):
    """A classifier whose training loss is NaN from optimizer step ``step`` on (1-based; one batch per
    step), or at that step only with ``once=True``."""

    def __init__(self, step: int, once: bool = False, dim: int = 8, classes: int = 4):
        super().__init__()
        self.inner = Supervised(fixtures.mlp(dim=dim, classes=classes))
        self.step, self.once, self.calls = step, once, 0

    def forward(self, batch):
        out = self.inner(batch)
        if self.training:
            self.calls += 1
            if self.calls == self.step or (self.calls > self.step and not self.once):
                out["loss"] = out["loss"] * float("nan")
        return out

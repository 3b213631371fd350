"""``device=gpu`` on a real CUDA device: training, the half precisions (bfloat16 autocast, float16 with dynamic
loss scaling), the batched fetch into pinned memory, checkpoints that resume exactly on the GPU and load on
the CPU, evaluation, DDP over NCCL, and the CLI. Skipped where CUDA is absent (CI has no GPU)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import csframework as csf

import fixtures

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TENSORS = "data.train._target_=fixtures.tensor_blobs"


class Record:
    """Each step's loss, as the loop hands it to the plugins."""

    name = "record"

    def __init__(self):
        self.losses: list[float] = []

    @csf.hookimpl
    def on_train_batch_end(self, outputs):
        self.losses.append(float(outputs["loss"]))


def fit(output_dir, *overrides, plugins=()) -> tuple[csf.Run, Record]:
    record = Record()
    run = csf.Run(fixtures.compose(*overrides), output_dir=output_dir, plugins=[record, *plugins])
    summary = run.fit()
    assert summary["status"] == "completed", summary
    return run, record


def params(run: csf.Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()}


def test_float32_on_the_gpu_trains_as_on_the_cpu(tmp_path):
    gpu, gpu_rec = fit(tmp_path / "gpu", "device=gpu", "loop.max_steps=16")
    cpu, cpu_rec = fit(tmp_path / "cpu", "device=cpu", "loop.max_steps=16")
    assert next(gpu.model.parameters()).device.type == "cuda"
    assert gpu_rec.losses == pytest.approx(cpu_rec.losses, rel=1e-4)
    a, b = params(gpu), params(cpu)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_float32_matmul_precision_is_set_for_the_run(tmp_path):
    before = torch.get_float32_matmul_precision()
    try:
        run, record = fit(tmp_path, "device=gpu", "backend.float32_matmul_precision=high", "loop.max_steps=16")
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        assert sum(record.losses[-4:]) < sum(record.losses[:4])
    finally:
        torch.set_float32_matmul_precision(before)


def test_bfloat16_computes_in_bfloat16_over_float32_weights_and_learns(tmp_path):
    seen, record = [], Record()
    run = csf.Run(fixtures.compose("device=gpu", "precision=bfloat16", "loop.max_steps=40"),
                  output_dir=tmp_path, plugins=[record])
    run.model.net[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    assert run.fit()["status"] == "completed"
    assert set(seen) == {torch.bfloat16}, "the forward pass runs under bfloat16 autocast"
    assert all(p.dtype == torch.float32 for p in run.model.parameters()), "master weights stay float32"
    assert sum(record.losses[-5:]) < 0.7 * sum(record.losses[:5])


def test_float16_dynamic_loss_scaling_skips_overflowing_steps_and_backs_off(tmp_path):
    # a first scale of 2**40 overflows float16 gradients (max 65504): every step is skipped, the scale halves
    run = csf.Run(fixtures.compose("device=gpu", "precision=float16", "precision.init_scale=1099511627776",
                                   "loop.max_steps=6"), output_dir=tmp_path / "overflow")
    before = params(run)
    assert run.fit()["status"] == "completed"
    assert run.backend.loss_scale() == 2.0 ** 34
    after = params(run)
    assert all(torch.equal(before[k], after[k]) for k in before), "an overflowing step changes no parameter"
    # a sane first scale: the steps apply and the model learns
    run, record = fit(tmp_path / "sane", "device=gpu", "precision=float16", "loop.max_steps=40")
    assert run.backend.loss_scale() == 65536.0
    assert sum(record.losses[-5:]) < 0.7 * sum(record.losses[:5])


def test_the_batched_fetch_into_pinned_memory_reads_the_same_batches_as_the_per_sample_loader(tmp_path):
    batched, batched_rec = fit(tmp_path / "batched", "device=gpu", TENSORS, "loop.max_steps=20")
    assert all(t.is_pinned() for t in next(iter(batched.train_loader))), "pinned by default on the GPU"
    getbatch = csf.Run(fixtures.compose("device=gpu", "data.train._target_=fixtures.AugmentedBlobs"),
                       output_dir=tmp_path / "getbatch")
    assert all(t.is_pinned() for t in next(iter(getbatch.train_loader))), "a __getbatch__ batch is pinned too"
    per_sample, per_sample_rec = fit(tmp_path / "per-sample", "device=gpu", TENSORS, "data.batched_fetch=false",
                                     "loop.max_steps=20")
    assert batched_rec.losses == per_sample_rec.losses
    a, b = params(batched), params(per_sample)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_gpu_checkpoint_resumes_exactly_on_the_gpu_and_loads_on_the_cpu(tmp_path):
    common = ["precision=float16", TENSORS, "loop.max_steps=12"]
    straight, straight_rec = fit(tmp_path / "straight", "device=gpu", *common)
    fit(tmp_path / "run", "device=gpu", *common[:-1], "loop.max_steps=5")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000005"
    resumed, resumed_rec = fit(tmp_path / "resumed", "device=gpu", *common, f"checkpoint.resume={checkpoint}")
    assert resumed_rec.losses == straight_rec.losses[5:]
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.backend.loss_scale() == straight.backend.loss_scale(), "the loss scaler's state travels"
    # the same checkpoint, read by a run on the CPU: float16 autocast is GPU-only, so that run uses float32
    on_cpu, _ = fit(tmp_path / "cpu", "device=cpu", TENSORS, "loop.max_steps=12", f"checkpoint.resume={checkpoint}")
    assert on_cpu.global_step == 12 and next(on_cpu.model.parameters()).device.type == "cpu"


def test_evaluation_on_the_gpu_matches_the_cpu(tmp_path):
    gpu = csf.Run(fixtures.compose("device=gpu", "loop.max_steps=4"), output_dir=tmp_path / "gpu").fit()
    cpu = csf.Run(fixtures.compose("device=cpu", "loop.max_steps=4"), output_dir=tmp_path / "cpu").fit()
    for key in ("val/loss", "val/accuracy"):
        assert gpu["metrics"][key] == pytest.approx(cpu["metrics"][key], rel=1e-4), key


class NoSyncBetweenBoundaries:
    """Runs every step whose neighbours are no boundary under ``torch.cuda.set_sync_debug_mode("error")``, from
    the end of the step before (the batch's fetch and copy to the device included) to its ``on_train_step_end``:
    a call there that makes the host wait for the device raises, naming its line. The first step (CUDA's
    libraries and the optimizer's state are set up) and the boundaries (logs, evaluations, checkpoints) may
    synchronise."""

    name = "no_sync_between_boundaries"

    def __init__(self, boundaries: set[int]):
        self.boundaries = boundaries
        self.checked: list[int] = []

    @csf.hookimpl(trylast=True)
    def on_train_step_end(self, step):
        between = step not in self.boundaries and step + 1 not in self.boundaries
        torch.cuda.set_sync_debug_mode("error" if between else "default")
        if between:
            self.checked.append(step + 1)

    @csf.hookimpl(tryfirst=True)
    def on_train_end(self):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("case, overrides", [
    ("default", ["model=tiny_transformer", "data=stdlib_text", "optimizer=adamw"]),
    ("default-bfloat16", ["model=tiny_transformer", "data=stdlib_text", "optimizer=adamw", "precision=bfloat16"]),
    # dynamic loss scaling (AdamW fused: the overflow check stays on the device), the batched fetch, accumulation
    ("float16", ["precision=float16", TENSORS, "optimizer=adamw", "loop.grad_accum_steps=2"]),
    ("per-sample-loader", ["optimizer=sgd", "optimizer.momentum=0.9", "optimizer.max_grad_norm=1"]),
])
def test_no_step_between_the_boundaries_waits_for_the_device(tmp_path, case, overrides):
    guard = NoSyncBetweenBoundaries(boundaries={8, 10, 12, 16})
    try:
        run = csf.Run(fixtures.compose("device=gpu", "loop.max_steps=16", "loop.log_every=8", "loop.eval_every=12",
                                       "loop.eval_steps=2", "checkpoint.every_steps=10", *overrides),
                      output_dir=tmp_path, plugins=[guard])
        assert run.fit()["status"] == "completed"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.checked == [2, 3, 4, 5, 6, 7, 14, 15]


@pytest.mark.slow
def test_the_cli_trains_the_embedded_default_on_the_gpu_in_bfloat16(tmp_path, cli_env):
    done = subprocess.run([sys.executable, "-m", "csframework", "device=gpu", "precision=bfloat16",
                           "loop.max_steps=30", "loop.eval_every=15", f"hydra.run.dir={tmp_path}"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["device_type"] == "GPU"
    assert summary["peak_memory"]["cuda_max_allocated_mb"] > 0


@pytest.mark.slow
def test_ddp_over_nccl_trains_as_one_process(tmp_path, cli_env):
    torchrun = Path(sys.executable).with_name("torchrun")
    torchrun = str(torchrun) if torchrun.exists() else shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    common = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "device=gpu", "loop.max_steps=12",
              "loop.log_every=4", "optimizer=sgd", "optimizer.lr=0.1"]
    ddp = subprocess.run([torchrun, "--nproc_per_node=1", "-m", "csframework", *common, "backend.strategy=ddp",
                          f"hydra.run.dir={tmp_path / 'ddp'}"], env=cli_env, capture_output=True, text=True,
                         timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "csframework", *common, f"hydra.run.dir={tmp_path / 'single'}"],
                            env=cli_env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("ddp", "single"))
    assert a["status"] == "completed" and a["global_step"] == 12
    assert a["metrics"]["train/loss"] == pytest.approx(b["metrics"]["train/loss"], rel=1e-4)
    assert a["metrics"]["val/loss"] == pytest.approx(b["metrics"]["val/loss"], rel=1e-4)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_compiled_step_on_the_gpu_trains_as_eager(tmp_path, mode):
    """backend.compile=true on CUDA (reduce-overhead: CUDA graphs): the same parameters as the eager GPU run,
    no graph break, no recompilation, and a schedule that changes the rate every step recompiles nothing."""
    common = ("device=gpu", "loop.max_steps=16", "optimizer=adamw", "optimizer.lr=0.01",
              "optimizer.schedule.name=cosine", "optimizer.schedule.warmup_steps=4", "optimizer.max_grad_norm=1.0")
    eager, _ = fit(tmp_path / "eager", *common)
    compiled, _ = fit(tmp_path / "compiled", *common, "backend.compile=true", f"backend.compile_mode={mode}")
    block = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compile"]
    assert block["mode"] == mode and block["graph_breaks"] == 0 and block["recompiles"] == 0, block
    a, b = params(eager), params(compiled)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_compiled_step_on_the_gpu_in_bfloat16_learns(tmp_path):
    run, record = fit(tmp_path / "run", "device=gpu", "precision=bfloat16", "loop.max_steps=40", "backend.compile=true")
    assert record.losses[-1] < record.losses[0]
    assert run.backend.compiled.summary()["graph_breaks"] == 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_compiled_step_on_the_gpu_in_float16_skips_overflowing_steps_like_eager(tmp_path, mode):
    """Dynamic loss scaling under backend.compile: the compiled update skips the overflowing steps on the device,
    with eager's scale and step counts, and then learns."""
    common = ("device=gpu", "precision=float16", "precision.init_scale=4194304", "loop.max_steps=24",
              "optimizer=adamw", "optimizer.lr=0.01")
    eager, _ = fit(tmp_path / "eager", *common)
    compiled, record = fit(tmp_path / "compiled", *common, "backend.compile=true", f"backend.compile_mode={mode}")
    block = compiled.backend.compiled.summary()
    assert block["graph_breaks"] == 0 and block["recompiles"] == 0 and compiled.backend.compiled.update == "compiled"
    assert compiled.backend.loss_scale() == eager.backend.loss_scale()
    steps = lambda run: {float(s["step"]) for s in run.optimizer.state.values()}  # noqa: E731
    assert steps(compiled) == steps(eager)
    a, b = params(eager), params(compiled)
    for name in a:  # float16 products round differently once fused
        torch.testing.assert_close(a[name], b[name], rtol=1e-2, atol=1e-3, msg=name)
    assert sum(record.losses[-5:]) < sum(record.losses[:5])

"""``CsxBackend``: the run's backend for ``device=csx``.

The training step (``csframework.step.train_step``: forward, loss, backward with loss scaling, gradient
clipping, optimizer update, with the learning rate and the global step as graph inputs) is traced into one
static graph at the first step and that graph runs every step. The loop receives each step's outputs through
a step closure, as user code does.

Gradient accumulation (``loop.grad_accum_steps=k``): the micro-batches of a step are buffered on the host
and one graph runs the k forward/backward passes (unrolled) and the update, when the last micro-batch
arrives; the outputs of the step (those of its last micro-batch, as on CPU/GPU) come back then, and the
earlier micro-batches' ``train_batch`` calls return ``{}``.
"""
from __future__ import annotations

import torch

from ... import step
from ...data import epoch_batches, move_to
from ...jsonout import dumps
from ..base import BackendBase
from ...graph import optim as graph_optim
from ...graph.compiler import CompileCache, Compiled, StaticStep, device_for_host
from ...graph.tracer import step_closure
from .precision import CsxPrecision, csx_numerics_key
from .schema import DEFAULT_COMPILE_DIR


class CsxBackend(BackendBase):
    """The CSX emulator behind ``Run`` (see ``docs/guides/csx.md``). ``backend.num_csx`` and the other settings
    were checked by the CSX plugin's validation rules before it is built."""

    device_type = "CSX"

    def __init__(self, run):
        cfg = run.stage_config
        b = cfg.backend
        self.device = device_for_host()
        if b.threads:
            torch.set_num_threads(b.threads)
        self.retrace = b.retrace_every_iteration
        self.compile_only, self.validate_only = b.compile_only, b.validate_only
        self.dry_run = "compiled" if b.compile_only else "validated" if b.validate_only else None
        self.num_csx, self.num_workers_per_csx = b.num_csx, b.num_workers_per_csx
        self.cache = CompileCache(b.compile_dir or DEFAULT_COMPILE_DIR,
                                  lambda problem: run.log.warning("compile_cache_untrusted", problem=problem))
        self.graph_compiler = b.graph_compiler
        self.precision = CsxPrecision(cfg.precision, self.device)
        self.max_grad_norm = cfg.optimizer.max_grad_norm
        self.accum = cfg.loop.grad_accum_steps
        self.run = None
        self.train_step: StaticStep | None = None
        self.eval_step: StaticStep | None = None
        self.compiled: Compiled | None = None
        self.report_path = None
        self._pending: list = []
        self._delivered = None
        self._deliver = step_closure(self._store_outputs)
        self._carried = run.backend.counts() if isinstance(run.backend, CsxBackend) else {}  # earlier stages

    # -- assembly ---------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def attach(self, run) -> None:
        """Preinitialize the optimizer state and set up the traced train and eval steps."""
        self.run = run
        graph_optim.preinitialize(run.optimizer)
        extra = lambda: {"stage": run.stage, "device": str(self.device), "precision": self.precision.name,  # noqa: E731
                         "num_csx": self.num_csx, "num_workers_per_csx": self.num_workers_per_csx,
                         "grad_accum_steps": self.accum}
        self.train_step = StaticStep(self._train_step, "train_step", retrace=self.retrace, cache=self.cache,
                                     modules=[run.model], optimizers=[run.optimizer],
                                     extras=self.precision.scaler.state_attrs(), report_extra=extra,
                                     on_compile=self._compiled, graph_compiler=self.graph_compiler,
                                     key=csx_numerics_key(run.stage_config.precision))
        # evaluation graphs (one per batch shape) stay interpreted: compiling each would cost more than it saves
        self.eval_step = StaticStep(self._eval_step, "eval_step", retrace=self.retrace, cache=self.cache,
                                    keyed=True, modules=[run.model], report_extra=extra,
                                    key=csx_numerics_key(run.stage_config.precision))

    def to_device(self, batch):
        return batch if self.device.type == "cpu" else move_to(batch, self.device, non_blocking=True)

    # -- the traced steps -------------------------------------------------------------------------------
    def _store_outputs(self, outputs) -> None:
        self._delivered = outputs

    def _train_step(self, batches: list) -> None:
        self._deliver(step.train_step(self.run, self.precision, self.run.model, batches, self.max_grad_norm))

    def _eval_step(self, batch) -> None:
        with self.precision.autocast():
            outputs = step.model_outputs(self.run.model(batch), self.run.model)
        self._deliver(step.detached(outputs))

    # -- steps ------------------------------------------------------------------------------------------
    def train_batch(self, run, batch, last: bool) -> dict:
        if not last:
            self._pending.append(batch)
            return {}
        batches = [batch]
        if self._pending:
            batches, self._pending = self._pending + batches, []
        self._delivered = None
        train_step = self.train_step
        if train_step is None or train_step.first is None:
            train_step = self._traced()[0]
            self._compiling(run)
        train_step(((batches,)), {}, iteration=run.global_step + 1, global_step=run.global_step)
        return self._delivered

    def _traced(self) -> tuple[StaticStep, StaticStep]:
        """The traced train and eval steps (``attach`` makes them, before the stage's first batch)."""
        if self.train_step is None or self.eval_step is None:
            raise RuntimeError("CsxBackend: a batch before attach(); Run attaches the backend when a stage starts")
        return self.train_step, self.eval_step

    def _compiling(self, run) -> None:
        """Say what the first step is about to do: with Inductor, a graph new to ``compile_dir`` compiles with
        nothing else on the console (the ``compiled`` line then gives the seconds it took)."""
        if self.graph_compiler == "inductor":
            run.log.info("csx_compiling", graph="train_step", compile_dir=str(self.cache.directory),
                         note="a graph new to compile_dir is compiled by Inductor now, a cached one is loaded; "
                              "backend.graph_compiler=none runs the graph interpreted, without compiling")

    def eval_batch(self, run, batch) -> dict:
        self._delivered = None
        eval_step = self._traced()[1]
        with torch.no_grad():
            eval_step((batch,), {}, iteration=eval_step.executions + 1, global_step=run.global_step)
        return self._delivered

    # -- compile_only / validate_only ---------------------------------------------------------------------
    def dry_stage(self, run) -> None:
        """``compile_only`` / ``validate_only``: trace (and compile) this stage's train step, train nothing."""
        batches = []
        for batch in epoch_batches(run.train_loader, run.epoch, run.batch_in_epoch):
            batches.append(self.to_device(batch))
            if len(batches) == self.accum:
                break
        if self.compile_only:
            compiled = self._traced()[0].compile_only(((batches,)), {})
            run.log.info("compile_only", stage=run.stage, fingerprint=compiled.fingerprint,
                         cache=compiled.report["cache"]["status"], ops=compiled.report["ops"]["total"],
                         report=str(self.report_path))
        else:
            traced = self._traced()[0].validate_only(((batches,)), {})
            self.validated_ops = sum(1 for n in traced.gm.graph.nodes if n.op == "call_function")
            run.log.info("validate_only", stage=run.stage, ops=self.validated_ops,
                         result="the step traces into a static graph; nothing was executed")

    def _compiled(self, compiled: Compiled) -> None:
        """Write the compile report of the train step to the run directory."""
        self.compiled = compiled
        run = self.run
        name = "compile_report.json" if run.stage == "main" else f"compile_report.{run.stage}.json"
        report = dict(compiled.report, mode="compile_only" if self.compile_only else "train",
                      retrace_every_iteration=self.retrace)
        try:
            self.report_path = run.files.write(name, dumps(report, indent=2, where=name), durable=False)
        except OSError as e:
            run.log.warning("compile_report_not_written", error=str(e))
        info = compiled.report.get("graph_compiler", {})
        if info.get("status") == "fallback":
            run.log.warning("csx_graph_compiler_fallback", compiler=info["name"], reason=info["reason"],
                            result="the interpreted graph runs (backend.graph_compiler=none avoids the attempt)")
        if not self.compile_only:
            run.log.info("compiled", graph="train_step", fingerprint=compiled.fingerprint,
                         cache=compiled.report["cache"]["status"], ops=compiled.report["ops"]["total"],
                         trace_seconds=compiled.report["trace_seconds"], graph_compiler=info.get("status"),
                         **({"graph_compile_seconds": info["seconds"]} if "seconds" in info else {}))

    # -- state and summary ------------------------------------------------------------------------------
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (one synchronisation), or ``None`` without dynamic scaling."""
        scaler = self.precision.scaler
        return float(scaler.scale) if scaler.dynamic else None

    def state_dict(self) -> dict:
        return {"precision": self.precision.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.precision.scaler.load_state_dict(state.get("precision", {}))

    def compile_figures(self) -> dict | None:
        """The compile report's figures for the model summary: op count and memory estimates (MB)."""
        if self.compiled is None:
            return None
        report = self.compiled.report
        return {"ops": report["ops"]["total"], "trace_seconds": report.get("trace_seconds"),
                "memory_mb": {key.replace("_bytes", ""): round(value / 1e6, 3)
                              for key, value in report.get("memory", {}).items()}}

    def counts(self) -> dict:
        train = self.train_step.stats() if self.train_step else {}
        evals = self.eval_step.stats() if self.eval_step else {}
        now = {"traces": train.get("traces", 0), "eval_traces": evals.get("traces", 0),
               "executions": train.get("executions", 0), "eval_executions": evals.get("executions", 0),
               "trace_seconds": train.get("trace_seconds", 0.0) + evals.get("trace_seconds", 0.0)}
        return {k: v + self._carried.get(k, 0) for k, v in now.items()}

    def graph_compile_seconds(self) -> float:
        """Seconds spent analysing the train step's graph and compiling it (or loading it) with Inductor."""
        if self.compiled is None:
            return 0.0
        report = self.compiled.report
        # analysis_seconds: this process's analysis (a cache hit reads it back: compile_seconds is then the
        # cached analysis's own, not this run's)
        compiler = report.get("graph_compiler") or {}
        return float(report.get("analysis_seconds") or 0.0) + float(compiler.get("seconds") or 0.0)

    def compile_seconds(self) -> float:
        """Seconds spent tracing the step and evaluation (retraces included) and compiling their graph."""
        return float(self.counts()["trace_seconds"]) + self.graph_compile_seconds()

    def summary(self) -> dict:
        out = self.counts()
        out["trace_seconds"] = round(out["trace_seconds"], 4)
        out["graph_compile_seconds"] = round(self.graph_compile_seconds(), 4)
        out.update(num_csx=self.num_csx, retrace_every_iteration=self.retrace, host=str(self.device))
        if self.compile_only or self.validate_only:
            out["backend_mode"] = "compile_only" if self.compile_only else "validate_only"
        if self.compiled is not None:
            out.update(graph_fingerprint=self.compiled.fingerprint,
                       graph_compiler=self.compiled.report.get("graph_compiler", {}).get("status"),
                       compile_cache=self.compiled.report["cache"]["status"],
                       compile_report=str(self.report_path) if self.report_path else None)
        return out


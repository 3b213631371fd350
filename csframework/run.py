"""``Run``: assembles model, stages (``csframework.stage``: backend, data, optimizer, schedule), precision
and plugins from a ``RunConfig``, and exposes them and the run's position (the loop's record, ``run.state``)
to plugins, each under one name (``protocol.RunProtocol``)."""
from __future__ import annotations

import copy
import os
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import pluggy
import torch
from omegaconf import DictConfig

from . import carried, failures, finite, loop, modes, testset
from .backends.distributed import distribution, peer_lost
from .graph.cachedir import usable_inductor_env
from .builtin import builtin_plugins
from .builtin.checkpoint import schema
from .builtin.logs import quiet_logger
from .config import RunConfig, run_stages
from .config.readonly import freeze
from .data import FrameworkLoader, total_steps
from .errors import ConfigError, ValidationError, WrongProcessError
from .files import SafeDir
from .jsonout import JsonDict
from .mirror import Mirror, RecordView
from .param_groups import ParamGroup
from .plugins import Hooks, backend_specs, build_manager, check_sections, named_backend_specs, validation_problems
from .protocol import Backend
from .fresh_run import writing
from .rundir import default_output_dir
from .schedule import scale_run_lr
from .rng import seed_everything
from .signals import stop_on_signals
from .stage import Stage, backend_spec, build_stage
from .state import RunState
from .targets import build

class Run(RecordView):
    """One run: ``Run(config, plugins=[...]).fit()``.

    What a plugin reads and calls on ``run``, each piece under one name (``protocol.RunProtocol`` lists them
    all): ``config`` (the run's ``RunConfig``, a copy of the one given, read-only once validated), ``stage`` /
    ``stage_config`` (the current stage's name and merged config, read-only too), ``model``, ``module`` (what
    the steps call: a DDP wrapper under DDP), ``optimizer``, ``scheduler``, ``backend``, ``device_type``
    (``"CPU"|"GPU"|"CSX"|...``), ``output_dir``, ``files``, ``log`` (a structlog logger), ``mode`` (``"fit"``,
    ``"validate"``, ``"test"`` or ``"predict"``: what the run is doing), ``status``, ``rank`` /
    ``world_size``; during ``on_eval_end`` ``eval_outputs`` (the outputs named in ``loop.collect``, name ->
    CPU tensor in dataset order; complete on rank 0, empty on the other ranks; see ``csframework.collect``).
    Plugins may add entries to ``summary_extra`` (merged into ``summary.json``). ``already_complete``:
    ``fit`` resumed the run at its end and had nothing to train. ``error_file``: the run directory's
    ``error.txt``, which holds the traceback when the user's code (a forward, a dataset, a plugin) failed it.

    The run's position, stop request and metrics are read-only attributes too, ``RunState``'s fields of the
    same names (``mirror.RecordView``; ``RunState`` documents each): ``global_step``, ``stage_index``,
    ``stage_step``, ``epoch``, ``batch_in_epoch``, ``micro_step``, ``epoch_end``, ``last_eval_step``,
    ``stop_signal``, ``stopping``, ``stop_reason``, ``metrics``, ``carried`` and the timings. ``run.state`` is
    that record itself, which the loop writes and csframework's loop, step and backends read
    (``protocol.LoopRun``); it stays readable, but a plugin reads ``run.<name>``.
    """

    def __init__(self, config: RunConfig, plugins: Iterable[Any] = (),
                 output_dir: str | os.PathLike | None = None, *, manager: pluggy.PluginManager | None = None):
        """``plugins``: objects registered besides the installed and built-in ones; ``manager``: the plugin
        manager composition built for ``config`` (the CLI's: ``api.Composition.manager``), else built here."""
        if not isinstance(config, RunConfig):  # composition is api's: one way in
            made = ("csf.compose([...])" if config is None or isinstance(config, (list, tuple))
                    else "csframework.api.to_run_config(cfg)" if isinstance(config, DictConfig) else "csf.compose(...)")
            raise TypeError(f"Run takes a RunConfig, not {type(config).__name__}: make one with {made}")
        # the run's own copy: the caller's stays as it was (and mutable) whatever the run does
        self.config: RunConfig = copy.deepcopy(config)
        config = self.config
        if manager is None:
            manager = build_manager(builtin_plugins(), config.plugins.enable, plugins, config.plugins.disable)
        else:
            for plugin in plugins:
                manager.register(plugin)
        check_sections(manager, config)
        self.hooks = Hooks(manager)
        self.backends = backend_specs(self.hooks)
        self.named_backends = named_backend_specs(self.hooks)
        self.hooks.csframework_configure(config=config)
        self.stages = run_stages(config)
        problems = validation_problems(self.hooks, config)
        if problems:
            raise ValidationError(problems)
        freeze(config)  # from here on the run is what its config says: plugins may read it, not change it
        for name, cfg in self.stages:
            freeze(cfg, f"run.stage_config (stage {name})")

        self.output_dir = Path(output_dir) if output_dir is not None else default_output_dir()
        self.run_id = uuid.uuid4().hex[:12]
        self.device_type = config.device.type
        self.log = quiet_logger()
        usable_inductor_env(lambda problem: self.log.warning("compile_cache_untrusted", problem=problem))
        self.status = "created"
        self.state = RunState()
        self._pid = os.getpid()  # the run's process: request_stop anywhere else could not reach the run
        self.eval_outputs: dict[str, torch.Tensor] = {}  # loop.collect's outputs, during on_eval_end
        self.mode = "fit"  # what the run is doing: "fit", "validate", "test" or "predict"
        # checked as set: a value JSON cannot hold is the setting plugin's error, naming its key
        self.summary_extra: dict[str, Any] = JsonDict("summary_extra")
        self.already_complete = False  # fit found the run at its end (resumed there): nothing was trained
        self.error_file: Path | None = None  # error.txt, once the user's code failed the run (failures.py)
        self._started = False  # fit or validate ran: the run directory holds this run's own records
        self.eval_set: str | None = None  # the set an evaluation is reading
        self.rank, self.world_size = 0, 1  # the backend's, once the first stage's is built
        self._current: Stage | None = None  # set by enter_stage

        seed_everything(config.seed)
        self.model: torch.nn.Module = build(config.model, "model")
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"model._target_ must build a torch.nn.Module, got {type(self.model).__name__}")
        self.state.carried = carried.for_model(self.model, self.stages)  # None: a stateless model
        self.enter_stage(0)

    @property
    def files(self) -> SafeDir:
        """The run directory through csframework's safe file layer (``csframework.files.SafeDir``): what a
        plugin writes there should go through it too (no planted link followed, every write atomic)."""
        return SafeDir(self.output_dir)

    def request_stop(self, reason: str) -> None:
        """Stop training after the current step as at a normal end: the final evaluation and checkpoint
        run, later stages are skipped, ``summary.json`` says ``status: completed`` and ``stop_reason``.
        Under DDP, call it on every rank (evaluation metrics are the same on every rank). Only in the run's
        own process (in hooks): anywhere else (a ``Dataset`` in a loader worker, a forked child) it raises
        ``WrongProcessError``, as the run would never see it."""
        if os.getpid() != self._pid:
            raise WrongProcessError(
                f"run.request_stop({reason!r}) was called in process {os.getpid()}, not in the run's process "
                f"{self._pid} (a data-loader worker or another child process), where the run would never see "
                "it; call it from a hook, which runs in the run's process (e.g. on_train_batch_end)")
        if self.state.stop_reason is None:
            self.state.stop_reason = str(reason)
            self.log.info("stop_requested", reason=self.state.stop_reason)

    # -- the current stage ---------------------------------------------------------------------------------
    @property
    def current(self) -> Stage:
        """The current stage's parts (``csframework.stage.Stage``), built by ``enter_stage``."""
        if self._current is None:
            raise AttributeError("the run's first stage is being built: it has no backend, loaders or optimizer yet")
        return self._current

    @property
    def backend(self) -> Backend:
        """The current stage's backend; while ``BackendSpec.create`` builds the next one, the previous stage's
        (``None`` for the first stage's: the only time it is not set)."""
        return self._current.backend if self._current is not None else None  # type: ignore[return-value]

    # the current stage's parts (``run.current``), read-only
    module: Mirror[torch.nn.Module] = Mirror("current")
    train_loader: Mirror[FrameworkLoader] = Mirror("current")
    eval_loaders: Mirror[dict[str, FrameworkLoader]] = Mirror("current")
    val_loader: Mirror[FrameworkLoader | None] = Mirror("current")
    param_groups: Mirror[list[ParamGroup]] = Mirror("current")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The stage's optimizer (a backend's ``attach`` may replace it)."""
        return self.current.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.current.optimizer = optimizer

    @property
    def scheduler(self) -> Any:
        """The stage's learning-rate schedule (a backend's ``attach`` may replace it)."""
        return self.current.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self.current.scheduler = scheduler

    @property
    def stage(self) -> str:
        return self.stages[self.state.stage_index][0]

    @property
    def stage_config(self) -> RunConfig:
        return self.stages[self.state.stage_index][1]

    def enter_stage(self, index: int) -> None:
        """Build the backend, data loaders, optimizer and schedule of stage ``index`` (the model is kept)."""
        self.release()  # the previous stage's loader workers and collectives
        self.state.enter_stage(index)
        cfg = self.stage_config
        backend = backend_spec(cfg, self.backends, self.named_backends).create(self)
        self.rank, self.world_size = backend.rank, backend.world_size
        if index == 0:  # all ranks share rank 0's run directory
            self.output_dir = Path(backend.broadcast(str(self.output_dir)))
        self._current = build_stage(backend, self.model, cfg)
        backend.attach(self)

    def total_steps(self, cfg: RunConfig) -> int:
        """Optimizer steps of a stage: ``loop.max_steps``, or ``max_epochs`` x steps per epoch."""
        return total_steps(cfg, self.train_loader)

    # -- running ----------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train every stage; returns the run's summary (see ``summary``), as ``validate`` does. A run
        resumed (``checkpoint.resume``) at its end, its final evaluation done, trains nothing and writes no
        checkpoint: ``already_complete`` is then ``True`` (``on_fit_start`` and ``on_fit_end`` run). A first fit
        or validate in a directory that holds another run is refused unless ``checkpoint.start_over``
        (``fresh_run.check_fresh_start``)."""
        owner = os.getpid()

        def body():
            self.mode, self.status, self.already_complete = "fit", "running", False
            self.hooks.on_fit_start(run=self)
            if not self.backend.dry_run and loop.finished(self):  # resumed from the checkpoint of its end
                self.already_complete, self.status = True, "completed"
                self.log.info("already_complete")
            else:
                self.status = loop.fit(self)
                if self.status == "completed" and testset.has_test_sets(self):
                    testset.test_after_fit(self)
            failures.leave_if_forked(owner)
            self.hooks.on_fit_end(run=self)
            return self.summary()

        with writing(self, first=not self._started), stop_on_signals(self.state):
            self._started = True  # refused (or the old run moved aside) before this, and before any writes
            return self._guarded(body)

    def validate(self) -> dict:
        """``mode=validate``: evaluate ``data.val`` once (``modes.validate``); returns the run's summary."""
        return modes.validate(self)

    def test(self) -> dict:
        """``mode=test``: evaluate the test sets once (``modes.test``); returns the run's summary."""
        return modes.test(self)

    def predict(self) -> dict:
        """``mode=predict``: write ``predictions.jsonl`` (``modes.predict``); returns the run's summary."""
        return modes.predict(self)

    def check(self) -> dict:
        """``mode=check``: everything is composed, validated and built; nothing is trained."""
        return {"status": "checked", "device_type": self.device_type, "stages": [n for n, _ in self.stages]}

    def _guarded(self, body):
        owner = os.getpid()
        try:
            return body()
        except BaseException as e:
            failures.leave_if_forked(owner, e)
            self.status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            if failures.is_user_failure(e):  # the user's code failed: its traceback is kept in error.txt
                self.error_file = failures.write_traceback(self, e)
            # every plugin cleans up, whichever fails doing so; the original error is the one raised
            for plugin, failure in self.hooks.each_isolated("on_exception", run=self, error=e):
                self.log.error("on_exception_failed", plugin=plugin, error=str(failure))
            if self.world_size > 1:
                lost = peer_lost(e, self.rank, getattr(self.stage_config.backend, "timeout_s", None))
                if lost is not None:
                    raise lost from e
            raise
        finally:
            self.release()

    def release(self) -> None:
        """Stop every data-loader worker process and wait for the backend's pending collectives. Run when
        ``fit``/``validate`` ends, however it ends, and before a stage's loaders and backend are replaced."""
        if self._current is not None:
            self._current.release()

    def flush_metrics(self) -> None:
        """Deprecated (called from a hook, it dispatched ``on_log_metrics`` inside it): ``set_save_due``."""
        warnings.warn("Run.flush_metrics is deprecated: call run.set_save_due(due), and the loop reports the "
                      "pending metrics before the hooks of a step you save at", DeprecationWarning, 2)
        if self.state.pending.get("loss"):
            loop.log_train_metrics(self)

    def check_finite(self) -> None:
        """Raise ``NonFiniteLossError`` naming the step if a training loss since the last log was NaN or
        infinite (under dynamic loss scaling: if the scale fell below ``precision.min_scale``), or if a
        parameter is not finite. One synchronisation; the checkpoint plugin calls it before saving (the loop
        has reported the pending losses then), so no checkpoint holds the state of a run gone non-finite."""
        finite.check_finite(self)
        finite.check_parameters_finite(self)

    def scale_lr(self, factor: float) -> None:
        """Multiply every learning rate by ``factor`` from the next step to the end of the stage, as every
        schedule respects and checkpoints keep (``schedule.scale_run_lr``), where writing
        ``optimizer.param_groups[i]["lr"]`` would be undone by the schedule's next rate."""
        scale_run_lr(self, factor)

    def report(self, metrics: dict[str, float]) -> None:
        """Record metrics (name -> number) at the current step and pass them to ``on_log_metrics``; during an
        evaluation (its hooks, ``on_eval_end`` included) they join its metrics and its one ``on_log_metrics``."""
        if not self.state.record(metrics):
            self.hooks.on_log_metrics(run=self, metrics=metrics, step=self.global_step)

    @property
    def distribution(self) -> dict[str, Any]:
        """Under torchrun: ``world_size``, ``strategy`` and ``process_group`` (``distributed.distribution``)."""
        return distribution(getattr(self.stage_config.backend, "strategy", None), self.world_size)

    def summary(self) -> dict:
        """What ``fit`` and ``validate`` return and ``summary.json`` holds: ``status`` (``completed``,
        ``failed``, ``interrupted``; on CSX ``compiled``/``validated`` for a dry run), ``mode`` (``fit`` or
        ``validate``), ``global_step``, ``device_type``, ``stage``, under torchrun ``world_size``,
        ``strategy`` and ``process_group`` (``distribution``), ``metrics`` (the latest value of every
        metric), ``run_id``, the backend's figures (on CSX: traces, executions, compile cache), what plugins
        put in ``summary_extra`` (e.g. ``best_checkpoint``) and, after ``request_stop``, ``stop_reason``."""
        summary = {"status": self.status, "mode": self.mode, "global_step": self.global_step,
                   "device_type": self.device_type, "stage": self.stage, **self.distribution,
                   "metrics": dict(self.metrics), "run_id": self.run_id, **self.backend.summary(),
                   **self.summary_extra}
        if self.stop_reason is not None:
            summary["stop_reason"] = self.stop_reason
        return summary

    # -- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything that decides the rest of the run, as tensors and plain values (loadable with
        ``torch.load(weights_only=True)``), laid out as ``builtin.checkpoint.schema.FIELDS`` says. Under
        ``strategy=fsdp`` the model and optimizer are ``None``: every rank writes its shards of them
        (``Backend.save_sharded``)."""
        return schema.run_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()`` (of this csframework or an older one: older layouts are converted):
        checks every value against this run's config (``DamagedCheckpoint``), enters the saved stage and
        restores every piece (``ConfigError`` when it belongs to another run)."""
        schema.load_run_state(self, state)


if TYPE_CHECKING:  # the type checker verifies that Run is what hooks, the step and backends are typed against
    from .protocol import LoopRun

    def _is_a_run(run: Run) -> LoopRun:
        return run

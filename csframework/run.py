"""``Run``: assembles backend, model, data, optimizer, precision and plugins from a ``RunConfig``, and
exposes them and the run's position (``run.state``, which the loop owns) to plugins."""
from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import structlog
import torch
from omegaconf import DictConfig

from . import failures, loop
from .backends.base import Backend
from .graph.cachedir import usable_inductor_env
from .builtin import builtin_plugins
from .config import RunConfig, stage_config
from .config.sections import eval_set_key, eval_sets
from .config.schema import plugin_sections
from .backends.distributed import peer_lost
from .config.readonly import freeze
from .data import build_collate, is_iterable, make_loader
from .errors import ConfigError, NonFiniteLossError, PluginError, ValidationError, WrongProcessError, one_line
from .files import SafeDir
from .jsonout import JsonDict
from .plugins import Hooks, backend_specs, build_manager, check_sections, named_backend_specs
from .rundir import check_fresh_start, run_dir_lock
from .rng import rng_state, seed_everything, set_rng_state
from .param_groups import ParamGroup, resume_problem
from .schedule import build_optimizer, build_scheduler
from .signals import stop_on_signals
from .state import RunState
from .targets import build

#: The layout of ``state_dict()``; a checkpoint of another layout is refused on load.
STATE_VERSION = 1


def default_output_dir() -> Path:
    """Hydra's output directory when Hydra runs the job, else ``outputs/<date>/<time>`` like Hydra's."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    now = datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")


def _quiet_logger():
    """Until the logging plugin sets one up: warnings and errors to stderr, nothing else."""
    return structlog.wrap_logger(
        structlog.PrintLogger(file=None),
        processors=[structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )


class Run:
    """One run: ``Run(config, plugins=[...]).fit()``.

    Attributes plugins rely on: ``config`` (the run's ``RunConfig``, a copy of the one given, read-only
    once validated), ``stage`` / ``stage_config`` (the current stage's name and merged config, read-only
    too), ``model``, ``module`` (what the steps call: a DDP wrapper under
    DDP), ``optimizer``, ``scheduler``, ``backend``, ``device_type`` (``"CPU"|"GPU"|"CSX"|...``),
    ``output_dir``, ``log`` (a structlog logger), ``mode`` (``"fit"`` or ``"validate"``: what the run
    is doing), ``status``, ``rank`` / ``world_size``, and ``state``
    (``RunState``: the position, the stop request and the metrics, written by the loop), whose fields are
    also read-only properties here: ``global_step``, ``stage_index``, ``stage_step``, ``epoch``,
    ``batch_in_epoch``, ``micro_step``, ``stop_signal`` (the SIGINT/SIGTERM that asked a running ``fit`` to
    stop, else ``None``), ``stopping`` (set at the step boundary where the run stops for it: the checkpoint
    plugin saves then), ``stop_reason`` (set by ``request_stop``) and ``metrics`` (latest value of every
    reported metric); during ``on_eval_end`` ``eval_outputs`` (the outputs named in ``loop.collect``, name ->
    CPU tensor in dataset order; complete on rank 0, empty on the other ranks; see ``csframework.collect``).
    Plugins may add entries to ``summary_extra`` (merged into ``summary.json``). ``already_complete``:
    ``fit`` resumed the run at its end and had nothing to train. ``error_file``: the run directory's
    ``error.txt``, which holds the traceback when the user's code (a forward, a dataset, a plugin) failed it.
    """

    backend: Backend | None = None

    def __init__(self, config: RunConfig, plugins: Iterable[Any] = (),
                 output_dir: str | os.PathLike | None = None):
        if not isinstance(config, RunConfig):  # composition is api's: one way in
            made = ("csf.compose([...])" if config is None or isinstance(config, (list, tuple))
                    else "csframework.api.to_run_config(cfg)" if isinstance(config, DictConfig) else "csf.compose(...)")
            raise TypeError(f"Run takes a RunConfig, not {type(config).__name__}: make one with {made}")
        plugins = list(plugins)
        # the run's own copy: the caller's stays as it was (and mutable) whatever the run does
        self.config: RunConfig = copy.deepcopy(config)
        config = self.config
        manager = build_manager(builtin_plugins(), config.plugins.enable, plugins, config.plugins.disable)
        check_sections(manager, config)
        self.hooks = Hooks(manager)
        self.backends = backend_specs(self.hooks)
        self.named_backends = named_backend_specs(self.hooks)
        self.hooks.csframework_configure(config=config)
        self.stages = self._stage_configs()
        problems = validation_problems(self.hooks, config)
        if problems:
            raise ValidationError(problems)
        freeze(config)  # from here on the run is what its config says: plugins may read it, not change it
        for name, cfg in self.stages:
            freeze(cfg, f"run.stage_config (stage {name})")

        self.output_dir = Path(output_dir) if output_dir is not None else default_output_dir()
        self.run_id = uuid.uuid4().hex[:12]
        self.device_type = config.device.type
        self.log = _quiet_logger()
        usable_inductor_env(lambda problem: self.log.warning("compile_cache_untrusted", problem=problem))
        self.status = "created"
        self.state = RunState()
        self._pid = os.getpid()  # the run's process: request_stop anywhere else could not reach the run
        self.eval_outputs: dict[str, torch.Tensor] = {}  # loop.collect's outputs, during on_eval_end
        self.mode = "fit"  # what the run is doing: "fit" or "validate"
        # checked as set: a value JSON cannot hold is the setting plugin's error, naming its key
        self.summary_extra: dict[str, Any] = JsonDict("summary_extra")
        self.already_complete = False  # fit found the run at its end (resumed there): nothing was trained
        self.error_file: Path | None = None  # error.txt, once the user's code failed the run (failures.py)
        self._started = False  # fit or validate ran: the run directory holds this run's own records
        self.train_loader = self.val_loader = None
        self.eval_loaders: dict[str, Any] = {}  # the stage's evaluation sets' loaders, by name
        self.eval_set: str | None = None  # the set an evaluation is reading
        self.param_groups: list[ParamGroup] = []  # the stage's optimizer's groups (optimizer.groups)

        seed_everything(config.seed)
        self.model: torch.nn.Module = build(config.model, "model")
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"model._target_ must build a torch.nn.Module, got {type(self.model).__name__}")
        self.module = self.model
        self.enter_stage(0)

    # -- the state, read-only -------------------------------------------------------------------------------
    global_step = property(lambda self: self.state.global_step, doc="Optimizer steps taken, over all stages.")
    stage_index = property(lambda self: self.state.stage_index, doc="The current stage's index.")
    stage_step = property(lambda self: self.state.stage_step, doc="Optimizer steps taken in this stage.")
    epoch = property(lambda self: self.state.epoch, doc="The stage's current training epoch (0-based).")
    batch_in_epoch = property(lambda self: self.state.batch_in_epoch, doc="Batches of the epoch consumed.")
    micro_step = property(lambda self: self.state.micro_step, doc="Batches of the stage consumed.")
    stop_signal = property(lambda self: self.state.stop_signal, doc="The signal that asked fit to stop.")
    stopping = property(lambda self: self.state.stopping, doc="This step is the last before stopping.")
    metrics = property(lambda self: self.state.metrics, doc="The latest value of every reported metric.")
    stop_reason = property(lambda self: self.state.stop_reason, doc="Why request_stop ended training, or None.")

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

    # -- assembly ---------------------------------------------------------------------------------------
    def _stage_configs(self) -> list[tuple[str, RunConfig]]:
        if not self.config.stages:
            return [("main", self.config)]
        return [(name, stage_config(self.config, name, partial)) for name, partial in self.config.stages.items()]

    @property
    def stage(self) -> str:
        return self.stages[self.state.stage_index][0]

    @property
    def stage_config(self) -> RunConfig:
        return self.stages[self.state.stage_index][1]

    def enter_stage(self, index: int) -> None:
        """Build the data loaders, optimizer, schedule and backend of stage ``index`` (the model is kept)."""
        self.release()  # the previous stage's loader workers and collectives
        self.state.enter_stage(index)
        cfg = self.stage_config
        name = getattr(cfg.backend, "name", None)  # a backend chosen by name (backend=cerebras), else the type's
        spec = self.named_backends.get(name) if name is not None else self.backends.get(cfg.device.type)
        if spec is None:
            raise ConfigError(f"device: no plugin supplies a backend for {cfg.device.type} "
                              f"(device types: {', '.join(self.backends) or 'none'}); check plugins.disable")
        self.backend = spec.create(self)
        self.rank, self.world_size = self.backend.rank, self.backend.world_size
        if index == 0:  # all ranks share rank 0's run directory
            self.output_dir = Path(self.backend.broadcast(str(self.output_dir)))
        self.module = self.backend.prepare_model(self.model)
        self.train_loader, self.eval_loaders = self._loaders(cfg)
        self.val_loader = next(iter(self.eval_loaders.values()), None)  # the first set's (data.val's)
        try:
            self.optimizer, self.param_groups = build_optimizer(
                self.model.named_parameters(), cfg.optimizer, fused=self.backend.fused_optimizer(self.model))
        except ValueError as e:  # torch's own range checks, if the validation plugin is disabled
            raise ConfigError(f"optimizer: {one_line(e)}") from e
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, self.total_steps(cfg))
        self.backend.attach(self)

    def _loaders(self, cfg: RunConfig):
        data = cfg.data
        train = build(data.train, "data.train")
        pin = data.pin_memory if data.pin_memory is not None else self.device_type == "GPU"
        common = dict(seed=cfg.seed, num_workers=data.num_workers, rank=self.rank, world_size=self.world_size,
                      pin_memory=pin, collate_fn=build_collate(data.collate_fn), timeout_s=data.timeout_s,
                      persistent_workers=data.persistent_workers, prefetch_factor=data.prefetch_factor,
                      batched_fetch=data.batched_fetch)
        train_loader = make_loader(train, data.batch_size, shuffle=data.shuffle, drop_last=data.drop_last,
                                   role="data.train", **common)
        if is_iterable(train_loader):
            if cfg.loop.max_steps is None:
                raise ConfigError("loop.max_steps: data.train is an IterableDataset, which has no length to count "
                                  "epochs in advance; set loop.max_steps (an epoch ends when its iterator does)")
        elif len(train) == 0:
            raise ConfigError(f"data.train: the dataset is empty ({type(train).__name__} has no sample); check it")
        elif len(train_loader) == 0:
            raise ConfigError(f"data.batch_size: {data.batch_size} is larger than the training set "
                              f"({len(train)} samples, {len(train_loader.position)} per process) with drop_last; "
                              "lower it")
        elif cfg.loop.max_steps is None and cfg.loop.max_epochs * len(train_loader) < cfg.loop.grad_accum_steps:
            raise ConfigError(f"loop.grad_accum_steps: a step takes {cfg.loop.grad_accum_steps} batches, and "
                              f"{cfg.loop.max_epochs} epoch(s) of {len(train_loader)} batch(es) make no step; "
                              "lower it, or raise loop.max_epochs")
        return train_loader, self._eval_loaders(cfg, common)

    def _eval_loaders(self, cfg: RunConfig, common: dict) -> dict:
        """A loader for each evaluation set (``data.val``, ``data.eval``), by name. With ``loop.eval_steps``
        a pass reads that many batches per process of samples drawn over the whole set (``data.eval_sample``)."""
        data, loaders = cfg.data, {}
        batch_size = data.eval_batch_size or data.batch_size
        steps = cfg.loop.eval_steps
        for name, spec in eval_sets(data).items():
            key = eval_set_key(data, name)
            dataset = build(spec, key)
            loader = make_loader(dataset, batch_size, shuffle=False, drop_last=False, role=key, pad=True,
                                 sample=steps * batch_size * self.world_size if steps else None, **common)
            if not is_iterable(loader) and len(dataset) == 0:
                raise ConfigError(f"{key}: the dataset is empty ({type(dataset).__name__} has no sample); "
                                  f"check it, or set {key}=null to train without evaluating it")
            loaders[name] = loader
        return loaders

    def total_steps(self, cfg: RunConfig) -> int:
        """Optimizer steps of a stage: ``loop.max_steps``, or ``max_epochs`` x steps per epoch."""
        if cfg.loop.max_steps is not None:
            return cfg.loop.max_steps
        # a step may span two epochs of a stage (only its end drops a partial step: loop._drop_partial_step)
        return cfg.loop.max_epochs * len(self.train_loader) // cfg.loop.grad_accum_steps

    # -- running ----------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train every stage; returns the run's summary (see ``summary``), as ``validate`` does. A run
        resumed (``checkpoint.resume``) at its end, its final evaluation done, trains nothing and writes no
        checkpoint: ``already_complete`` is then ``True`` (``on_fit_start`` and ``on_fit_end`` run). A first fit
        (no ``validate`` before it) in a directory that holds a run is refused unless ``checkpoint.start_over``
        (``rundir.check_fresh_start``)."""
        owner = os.getpid()

        def body():
            self.mode, self.status, self.already_complete = "fit", "running", False
            self.hooks.on_fit_start(run=self)
            if not self.backend.dry_run and loop.finished(self):  # resumed from the checkpoint of its end
                self.already_complete, self.status = True, "completed"
                self.log.info("already_complete")
            else:
                self.status = loop.fit(self)
            _leave_if_forked(owner)
            self.hooks.on_fit_end(run=self)
            return self.summary()

        with self._writer_lock(), stop_on_signals(self.state):
            if self.rank == 0 and not self._started:  # refused (or the old run moved aside) before any writes
                check_fresh_start(self)
            self._started = True
            return self._guarded(body)

    def validate(self) -> dict:
        """Evaluate on ``data.val`` once (``mode=validate``); returns the run's summary (see ``summary``),
        as ``fit`` does, whose ``metrics`` hold the ``val/*`` results.

        Set up and torn down as ``fit`` is (``on_fit_start``, the evaluation's hooks, ``on_fit_end``), with
        ``mode == "validate"`` and ``status == "validating"`` meanwhile: logging, metrics and ``summary.json``
        work as in a fit, and the checkpoint plugin restores ``checkpoint.resume`` first (a path evaluates a
        trained run's weights). After ``fit`` on the same ``Run``, it evaluates the trained weights.
        """
        if self.val_loader is None:
            raise ConfigError("data.val: mode=validate needs a validation dataset")

        def body():
            self.mode, self.status = "validate", "validating"
            self.hooks.on_fit_start(run=self)
            loop.evaluate(self)
            self.status = "completed"
            self.hooks.on_fit_end(run=self)
            return self.summary()

        with self._writer_lock():
            self._started = True  # what it writes is this run's: a fit after it goes on in the directory
            return self._guarded(body)

    def check(self) -> dict:
        """``mode=check``: everything is composed, validated and built; nothing is trained."""
        return {"status": "checked", "device_type": self.device_type, "stages": [n for n, _ in self.stages]}

    def _writer_lock(self):
        """Rank 0 holds the run directory's lock (``csframework.rundir``) while it runs: taken before any
        hook writes there; a run refused for it never reaches ``on_exception``, so the holder's
        ``summary.json`` is left alone."""
        return run_dir_lock(self.output_dir) if self.rank == 0 else contextlib.nullcontext()

    def _guarded(self, body):
        owner = os.getpid()
        try:
            return body()
        except BaseException as e:
            _leave_if_forked(owner, e)
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
        for loader in (self.train_loader, *self.eval_loaders.values()):
            close = getattr(loader, "close", None)  # a framework loader (None: not built yet)
            if close is not None:
                close()
        if self.backend is not None:
            self.backend.finish()

    def flush_metrics(self) -> None:
        """Report the training metrics of the steps since the last log now (``on_log_metrics``), after
        checking their losses (``NonFiniteLossError``). The checkpoint plugin calls it before saving, so a
        checkpoint, like ``summary.json``, holds the metrics of the steps before it."""
        if self.state.pending.get("loss"):
            loop.log_train_metrics(self)

    def check_finite(self) -> None:
        """Raise ``NonFiniteLossError`` naming the step if a training loss since the last log was NaN or
        infinite (under dynamic loss scaling: if the scale fell below ``precision.min_scale``), or if a
        parameter is not finite. One synchronisation; the checkpoint plugin calls it before saving, so no
        checkpoint holds the state of a run that has gone non-finite."""
        loop.check_finite(self)
        # sharded (fsdp): each rank checks its own shards, and all ranks agree (all of them save or none)
        flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in self.model.parameters()]
        finite = not flags or bool(torch.stack(flags).all())
        if self.backend.sharded:  # under ddp only rank 0 saves, so only a sharded backend's ranks all ask
            finite = self.backend.all_ranks_agree(finite)
        if not finite:
            names = [n for (n, _), ok in zip(self.model.named_parameters(), flags) if not ok] or ["(on another rank)"]
            raise NonFiniteLossError(f"parameter {names[0]} is not finite after step {self.global_step}; "
                                     "lower optimizer.lr, set optimizer.max_grad_norm, or use loss scaling")

    def report(self, metrics: dict[str, float]) -> None:
        """Record metrics at the current step and pass them to ``on_log_metrics``."""
        self.state.metrics.update(metrics)
        self.hooks.on_log_metrics(run=self, metrics=metrics, step=self.global_step)

    @property
    def distribution(self) -> dict[str, Any]:
        """Under torchrun (a process group exists): ``world_size``, ``strategy`` (``ddp``, ``fsdp``) and
        ``process_group`` (its backend: ``gloo``, ``nccl``), which the start line and ``summary.json`` show;
        empty in a single process."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        strategy = getattr(self.stage_config.backend, "strategy", None)
        return {"world_size": self.world_size, "strategy": getattr(strategy, "value", strategy),
                "process_group": str(dist.get_backend())}

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
        """Everything that decides the rest of the run, as tensors and plain values
        (loadable with ``torch.load(weights_only=True)``). Under ``strategy=fsdp`` the model and optimizer
        are not in it (``sharded``): every rank writes its shards of them (``Backend.save_sharded``)."""
        sharded = self.backend.sharded
        data = self._data_state()
        # a short last batch made the dataset's iterator end: its state is already the next pass's
        pass_ended = data is not None and self.train_loader.dataset.pass_ended
        whole: dict[str, Any]
        if sharded:
            whole = {"sharded": True}
        else:
            model, optimizer = self.backend.checkpoint_state(self.model, self.optimizer)
            whole = {"model": model, "optimizer": plain_rates(optimizer)}
        return {
            "version": STATE_VERSION,
            **whole,
            "param_groups": [group.describe() for group in self.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "backend": self.backend.state_dict(),
            "loop": dict(self.state.position(), stage=self.stage, **self._stop_record()),
            "rng": rng_state(),
            "data": data,
            **({"data_pass_ended": True} if pass_ended else {}),
        }

    def _check_param_groups(self, state: dict) -> None:
        """Refuse a checkpoint whose optimizer state belongs to other parameter groups: torch would load it
        by position, giving one group's state and settings to another's parameters."""
        problem = resume_problem(state.get("param_groups"), self.param_groups)
        saved = state.get("optimizer", {}).get("param_groups") if not state.get("sharded") else None
        if problem is None and state.get("param_groups") is None and saved is not None \
                and len(saved) != len(self.param_groups):
            problem = (f"it has {len(saved)} parameter group(s), this run {len(self.param_groups)} (it predates "
                       "optimizer.weight_decay_exclude, whose default now leaves biases and norm scales undecayed)")
        if problem:
            raise ConfigError(f"checkpoint: {problem}; resume it with the optimizer.groups and "
                              "optimizer.weight_decay_exclude it was saved with (optimizer.weight_decay_exclude=[] "
                              "decays every parameter, as before that setting), or start a new run")

    def _stop_settings(self) -> str:
        """What may decide a stop, as a string to compare: the plugins (by name), their config sections
        (``early_stopping.patience`` ...) and the stage's ``loop`` settings."""
        cfg, pm = self.stage_config, self.hooks.pm
        plugins = sorted(str(pm.get_name(p)) for p in pm.get_plugins())
        return repr({"plugins": plugins, "loop": cfg.loop, **{name: getattr(cfg, name) for name in plugin_sections(cfg)}})

    def _stop_record(self) -> dict[str, str]:
        """After ``request_stop``: why, and the settings the run stopped under (``_stop_settings``), which a
        resumed run compares with its own (``load_state_dict``): a stopped run is complete unless they changed."""
        if self.stop_reason is None:
            return {}
        return {"stop_reason": self.stop_reason, "stop_settings": self._stop_settings()}

    def _data_state(self):
        """The training dataset's own state, for an ``IterableDataset`` that has one and is read in this
        process (``data.num_workers=0``); otherwise resume re-reads the epoch to its position."""
        shards = self.train_loader.dataset
        if is_iterable(self.train_loader) and self.train_loader.num_workers == 0 and shards.stateful():
            return shards.state_dict()
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``: enters the saved stage and restores every piece."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"checkpoint: its state has layout version {state.get('version')}, this "
                              f"csframework reads version {STATE_VERSION}")
        position = state["loop"]
        if position["stage_index"] >= len(self.stages) or self.stages[position["stage_index"]][0] != position["stage"]:
            raise ConfigError(f"checkpoint: it was saved in stage '{position['stage']}', which this run "
                              f"does not have at that position (stages: {[n for n, _ in self.stages]})")
        if position["stage_index"] != self.state.stage_index:
            self.enter_stage(position["stage_index"])
        self._check_param_groups(state)
        if not state.get("sharded"):  # sharded: the checkpoint plugin loads them (Backend.load_sharded)
            try:
                self.model.load_state_dict(state["model"])
            except RuntimeError as e:
                raise ConfigError(f"checkpoint: the model does not match this run's model: {e}") from e
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.backend.load_state_dict(state["backend"])
        self.state.restore_position(position)
        reason = position.get("stop_reason")
        if isinstance(reason, str) and position.get("stop_settings") == self._stop_settings():
            self.state.stop_reason = reason  # finished means finished: loop.finished says so
        set_rng_state(state["rng"])
        if state.get("data") is not None and is_iterable(self.train_loader) and self.train_loader.num_workers == 0:
            self.train_loader.dataset.load_state_dict(state["data"], pass_ended=state.get("data_pass_ended", False))


def _leave_if_forked(owner: int, error: BaseException | None = None) -> None:
    """End this process if it is not ``owner`` but a child a plugin forked that came back into the run
    instead of exiting: it must not run the framework's completion or failure paths (``summary.json``,
    checkpoints, ``on_exception``), which are its parent's."""
    if os.getpid() == owner:
        return
    code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else int(error is not None)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def plain_rates(state: dict) -> dict:
    """An optimizer's ``state_dict`` with its learning rates as numbers: ``backend.compile`` keeps them in
    tensors, and a checkpoint loads into any backend (``state_dict`` copies each group, so the live tensors
    stay)."""
    for group in state.get("param_groups", ()):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def validation_problems(hooks: Hooks, config: RunConfig) -> list[str]:
    """The problems all ``csframework_validate`` implementations found. Each returns ``None`` or a list of
    strings (a string alone is one problem); any other result is refused naming the plugin (``PluginError``:
    a plugin whose verdict cannot be read must not let the run through)."""
    problems: list[str] = []
    for plugin, found in hooks.each("csframework_validate", config=config):
        if found is None:
            continue
        found = [found] if isinstance(found, str) else found
        if not isinstance(found, (list, tuple)):
            wrong = f"a value of type {type(found).__name__} ({found!r:.60})"
        else:
            wrong = next((f"a list holding a value of type {type(p).__name__} ({p!r:.60})"
                          for p in found if not isinstance(p, str)), None)
        if wrong:
            raise PluginError(plugin, "csframework_validate", TypeError(
                f"it returned {wrong}; return None or a list of strings, one per problem"))
        problems += found
    return problems



if TYPE_CHECKING:  # the type checker verifies that Run is what hooks, the step and backends are typed against
    from .protocol import RunProtocol

    def _is_a_run(run: Run) -> RunProtocol:
        return run

"""Every csframework hook, documented. Plugins implement them with ``@csframework.hookimpl``.

All hooks take keyword arguments only; an implementation may accept any subset of the arguments listed in
its spec (pluggy matches them by name). Hooks return ``None`` unless stated otherwise.

What a misbehaving plugin gets (exit statuses of the CLI):

- an implementation of a hook that does not exist (``on_train_batch_ends``), or with an argument its hook
  lacks, is refused when the run is built: ``ConfigError`` naming the plugin and the hook, with the hook
  probably meant or the hook's arguments; exit 2, nothing built. ``@hookimpl(optionalhook=True)`` marks an
  implementation of a hook that may not exist (it is then never called);
- an exception raised in a hook, ``sys.exit()`` / ``SystemExit`` included, fails the run: ``PluginError``
  naming the plugin and the hook, ``on_exception`` runs, ``summary.json`` says ``failed``; exit 1.
  ``KeyboardInterrupt`` is not a plugin failure: it stops the run as an interruption;
- ``run.config`` and ``run.stage_config`` are read-only from validation on: changing a setting
  (``run.config.optimizer.lr = 1``, ``run.config.model["net"]["hidden"] = 8``) raises
  ``csframework.errors.ReadOnlyConfigError`` (an ``AttributeError``), so the run fails as above. Change the
  config before the run, or in ``csframework_configure``. Its dicts and lists are read-only OmegaConf
  containers; ``copy.deepcopy(run.config)`` is an ordinary, mutable config.

Order within one optimizer step (``loop.grad_accum_steps = k``, so a step consumes k batches), as
``loop.train_epoch`` and ``loop.end_step`` read::

    for each of the step's k batches (micro-batches):
        on_train_batch_start(batch, batch_idx)
        on_before_backward(loss)
        on_after_backward()
        on the last one:
            on_before_optimizer_step(optimizer)       # before clipping and the optimizer step
            -- the global step advances; the step ends (loop.end_step): --
            on_log_metrics(metrics, step)             # when global_step % loop.log_every == 0, and at the
                                                      # stage's last step
            on_eval_start ... on_eval_end(metrics)    # when stage_step % loop.eval_every == 0 (or an epoch
            on_log_metrics(val metrics, step)         # of loop.eval_every_epochs ends), and at the stage's
                                                      # last step (its final evaluation)
            on_log_metrics(metrics, step)             # at a step the checkpoint plugin saves at (its
                                                      # run.set_save_due), the metrics not yet logged
        on_train_batch_end(batch, outputs, batch_idx)
    on_train_step_end(step, outputs)                  # once per optimizer step; the built-in checkpoint plugin
                                                      # saves after it (run.set_save_due's save), after the
                                                      # evaluation of the same step

The stage's last step is the one that reaches ``loop.max_steps``, the last full step of its last epoch
(``loop.max_epochs``), or a step after ``run.request_stop``: its final evaluation runs inside it, so a
checkpoint of that step holds that evaluation's metrics. (A stop requested after the step's evaluation,
in ``on_train_batch_end`` or ``on_train_step_end``, comes too late for it: the final evaluation then runs
after the step, before ``on_train_end``, and the checkpoint plugin writes that step's checkpoint again.)

Around the steps: ``on_fit_start`` > (per stage: ``on_train_start`` > (per epoch: ``on_train_epoch_start`` >
steps > ``on_train_epoch_end``) > ``on_train_end``) > ``on_fit_end``. Evaluation: ``on_eval_start`` >
``on_eval_epoch_start`` > (``on_eval_batch_start`` > ``on_eval_batch_end``)* > ``on_eval_epoch_end`` >
``on_eval_end``. ``run.validate()`` (``mode=validate``): ``on_fit_start`` > one evaluation > ``on_fit_end``,
with ``run.status == "validating"`` until it ends; ``run.test()`` and ``run.predict()`` likewise. A fit's test
sets (``data.test``) are tested after its last stage, before ``on_fit_end``, with the per-set hooks
(``on_eval_epoch_start`` ... ``on_eval_epoch_end``) only. On an error: ``on_exception`` then the error propagates.

Within one hook, the built-ins run before user and third-party plugins (pluggy calls the last registered
first; built-ins are registered last), except where a built-in marks itself ``tryfirst``/``trylast``: in
``on_fit_start`` the logging plugin sets up ``run.log`` and the checkpoint plugin resumes before any other
plugin; the checkpoint plugin saves in ``on_train_step_end`` after every other plugin; the logging plugin
closes its file in ``on_fit_end``/``on_exception`` after every other plugin, which may still log.
On CSX, the hooks inside the traced step (``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``) run when the step is traced, like any Python there; the others every step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from hydra.core.config_store import ConfigStore

    from .config import RunConfig
    from .protocol import BackendSpec, RunProtocol

PROJECT = "csframework"
#: Marks a hook specification (this module's functions, or a plugin's own ``add_hookspecs`` module).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin's implementation of a hook: ``@csframework.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- configuration --------------------------------------------------------------------------------------
@hookspec
def csframework_register_configs(config_store: ConfigStore) -> None:
    """Register structured configs or config files before Hydra composes.

    Called before each composition, for the plugins known then: entry points, the built-ins and the
    ``plugins.enable`` modules of the command line or ``csf.compose`` (not those set in a config file).

    :param config_store: Hydra's ``ConfigStore`` instance.
    """


@hookspec
def csframework_config_sections() -> dict[str, type] | None:
    """Return ``{section_name: dataclass_type}``: config sections of this plugin's own.

    Each section becomes a top-level key of the composed config holding the dataclass's defaults, set
    like a built-in section (``early_stopping.patience=3`` on the command line, a user YAML, a stage) and
    type-checked the same way; the plugin reads it as ``run.config.<section_name>`` (read-only during the
    run, like the rest). Asked before composition, so only plugins known then can declare one: installed
    entry points, the modules of ``plugins.enable`` given on the command line or to ``csf.compose``, and
    ``csf.compose(plugins=...)`` (not a plugin given only to ``Run(plugins=[...])`` with a composed
    config). A class plugin is instantiated (no arguments) to be asked.
    """


@hookspec
def csframework_device_types() -> list[str] | None:
    """The device types this plugin supplies a backend for (upper case, e.g. ``["CSX"]``); every plugin's
    list is joined. Asked before composition (entry points and built-ins), like ``csframework_backend``."""


@hookspec(firstresult=True)
def csframework_backend(device_type: str) -> BackendSpec | None:
    """The backend of ``device_type``: a ``csframework.backends.base.BackendSpec`` (its config schema, a
    factory of the ``Backend`` and the directory of its ``device/`` and ``backend/`` config files),
    or ``None`` for a type this plugin does not supply. The first non-``None`` answer wins (user plugins
    are asked before the built-in backends, which answer last, so a package may replace one). Its validation rules are
    the same plugin's ``csframework_validate``. See docs/guides/backends.md.

    :param device_type: the device type, upper case (``device.type``).
    """


@hookspec
def csframework_named_backends() -> list[BackendSpec] | None:
    """Backends chosen by name rather than by device type: each ``BackendSpec`` has ``name`` (``backend=<name>``
    selects it, e.g. ``backend=cerebras``) and runs an existing device type (``device_type``, e.g. ``CSX``)
    beside that type's own backend, which ``device=<type>`` keeps choosing. Its ``backend/<name>.yaml`` sets
    ``name: <name>`` and its schema has a ``name`` field; its ``type`` field is the backend's own. Asked
    before composition, like ``csframework_backend``; two plugins naming the same backend is an error."""


@hookspec
def csframework_configure(config: RunConfig) -> None:
    """Called after composition, before validation. May adjust the config in place: the last chance, since
    the run's config is read-only from validation on. ``Run(config)`` works on its own copy of a
    ``RunConfig``, so the caller's object is not changed.

    :param config: the run's typed ``RunConfig``.
    """


@hookspec
def csframework_validate(config: RunConfig) -> list[str] | None:
    """Check the config before anything is built.

    Return a list of problems (or ``None``). A problem is a plain string naming the key and the fix, e.g.
    ``"backend.num_csx: 0 must be between 1 and 16 (data.batch_size)"``; a string returned alone is one
    problem. Problems from every plugin are reported together and the run is refused (exit status 2) when
    there is any. Any other result (a dict, a number, ``True``, a list holding a non-string) is the
    plugin's error: ``PluginError`` naming it (exit 1), since its verdict cannot be read.

    :param config: the run's typed ``RunConfig`` (each stage's with ``config.stage_configs``).
    """


# -- fit ------------------------------------------------------------------------------------------------
@hookspec
def on_fit_start(run: RunProtocol) -> None:
    """Once, when ``run.fit()``, ``run.validate()``, ``run.test()`` or ``run.predict()`` starts (``run.mode`` is
    ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``, ``run.status`` ``"running"``, ``"validating"``,
    ``"testing"`` or ``"predicting"``), after the model, data and optimizer are built. The
    built-in checkpoint plugin loads ``checkpoint.resume`` first, so ``run.global_step`` already tells where
    training resumes.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_fit_end(run: RunProtocol) -> None:
    """Once, when ``run.fit()`` or ``run.validate()`` finished without error (``run.status == "completed"``).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_train_start(run: RunProtocol) -> None:
    """At the start of each stage's training (``run.stage`` names it), before the first epoch.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_train_end(run: RunProtocol) -> None:
    """At the end of each stage's training, after its last step and its final evaluation (if any: it runs
    within the last step, or just before this hook when a stop was requested after that step's evaluation).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_train_epoch_start(run: RunProtocol, epoch: int) -> None:
    """Before the first batch of training epoch ``epoch`` (0-based, counted across the stage).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param epoch: the training epoch, 0-based, counted across the stage.
    """


@hookspec
def on_train_epoch_end(run: RunProtocol, epoch: int) -> None:
    """After the last batch of epoch ``epoch``, or when the stage ends inside the epoch.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param epoch: the training epoch, 0-based, counted across the stage.
    """


@hookspec
def on_train_batch_start(run: RunProtocol, batch: Any, batch_idx: int) -> None:
    """Before the forward pass of each training batch. ``batch`` is on the run's device;
    ``batch_idx`` counts batches within the epoch.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param batch: the batch, on the run's device.
    :param batch_idx: the batch's index within the epoch (training) or the evaluation pass.
    """


@hookspec
def on_train_batch_end(run: RunProtocol, batch: Any, outputs: dict[str, Any], batch_idx: int) -> None:
    """After each training batch. ``outputs`` is the model's output dict with tensors detached (still on the
    device: read them with ``float()`` only when needed, since that synchronises). On the last batch of a
    step this runs after the optimizer step, the metric logging and the evaluation of that step.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param batch: the batch, on the run's device.
    :param outputs: the model's outputs with tensors detached, still on the device.
    :param batch_idx: the batch's index within the epoch (training) or the evaluation pass.
    """


@hookspec
def on_train_step_end(run: RunProtocol, step: int, outputs: dict[str, Any]) -> None:
    """After each optimizer step, once, whatever ``loop.grad_accum_steps`` is: after the step's last
    ``on_train_batch_end`` and after the metric logging and the evaluation of that step (so a plugin here sees
    the step's ``val/*`` metrics in ``run.metrics``). The built-in checkpoint plugin saves here, after every
    other plugin; at such a step the metrics not yet logged were reported before the step's hooks (no
    ``on_log_metrics`` is dispatched from inside this hook).

    :param run: the ``Run``.
    :param step: the global step just taken (``run.global_step``).
    :param outputs: the outputs of the step's last micro-batch, tensors detached, still on the device.
    """


# -- evaluation -----------------------------------------------------------------------------------------
@hookspec
def on_eval_start(run: RunProtocol) -> None:
    """Before an evaluation: once, before the passes over every evaluation set (``data.val``, then
    ``data.eval``'s; the model is in eval mode).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_eval_end(run: RunProtocol, metrics: dict[str, float]) -> None:
    """After an evaluation: once, after every set's pass. ``metrics`` maps names such as ``val/loss`` (and
    ``<set>/loss`` for each ``data.eval`` set, the ``metrics:`` section's ``<set>/<name>`` and what plugins
    ``run.report`` during the evaluation's earlier hooks) to floats; what is reported in this hook joins the
    evaluation's ``on_log_metrics`` after it; ``run.eval_outputs``
    holds the outputs named in ``loop.collect`` (name -> CPU tensor, every sample once in dataset order;
    complete on global rank 0, empty elsewhere; possibly memory-mapped, valid during this hook).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param metrics: metric names (``train/loss``, ``lr``, ``val/loss`` ...) to floats.
    """


@hookspec
def on_eval_epoch_start(run: RunProtocol, epoch: int) -> None:
    """Before the first batch of each evaluation set's pass (``run.eval_set`` names the set); ``epoch`` is
    the current training epoch.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param epoch: the training epoch, 0-based, counted across the stage.
    """


@hookspec
def on_eval_epoch_end(run: RunProtocol, epoch: int) -> None:
    """After the last batch of each evaluation set's pass (``run.eval_set`` names the set).

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param epoch: the training epoch, 0-based, counted across the stage.
    """


@hookspec
def on_eval_batch_start(run: RunProtocol, batch: Any, batch_idx: int) -> None:
    """Before the forward pass of each evaluation batch.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param batch: the batch, on the run's device.
    :param batch_idx: the batch's index within the epoch (training) or the evaluation pass.
    """


@hookspec
def on_eval_batch_end(run: RunProtocol, batch: Any, outputs: dict[str, Any], batch_idx: int) -> None:
    """After each evaluation batch; ``outputs`` as in ``on_train_batch_end``.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param batch: the batch, on the run's device.
    :param outputs: the model's outputs with tensors detached, still on the device.
    :param batch_idx: the batch's index within the epoch (training) or the evaluation pass.
    """


# -- inside the step ------------------------------------------------------------------------------------
@hookspec
def on_before_backward(run: RunProtocol, loss: torch.Tensor) -> None:
    """Before ``backward`` of each batch; ``loss`` is the (unscaled) loss tensor.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param loss: the (unscaled) loss tensor of this micro-batch.
    """


@hookspec
def on_after_backward(run: RunProtocol) -> None:
    """After ``backward`` of each batch; gradients may still be loss-scaled and are accumulated.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    """


@hookspec
def on_before_optimizer_step(run: RunProtocol, optimizer: torch.optim.Optimizer) -> None:
    """Once per step, before gradient clipping and ``optimizer.step()``; gradients are unscaled.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param optimizer: the stage's optimizer, gradients unscaled.
    """


# -- logging, checkpoints, errors -----------------------------------------------------------------------
@hookspec
def on_log_metrics(run: RunProtocol, metrics: dict[str, float], step: int) -> None:
    """Metrics to record: ``metrics`` maps names (``train/loss``, ``lr``, ``val/loss`` ...) to floats at
    global step ``step``. Logger plugins (CSV, TensorBoard, W&B ...) implement this.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param metrics: metric names (``train/loss``, ``lr``, ``val/loss`` ...) to floats.
    :param step: the global step the metrics belong to.
    """


@hookspec
def on_checkpoint_save(run: RunProtocol, state: dict[str, Any]) -> None:
    """A checkpoint is being written. Put JSON values (dicts with string keys, lists, strings, numbers,
    booleans, ``None``) into ``state[your_plugin_name]``; they come back in ``on_checkpoint_load`` on
    resume, as ``json`` reads them (tuples as lists; NaN and infinities as themselves).

    The state is checked after each plugin's call: anything else (a tensor, an object, a circular
    reference) is a ``PluginError`` naming the plugin whose call put it there and where it is
    (``state['best']['history'][3] is of type Tensor``), raised before anything is written: no checkpoint
    of that step exists, the previous ones stay complete and indexed, the run fails (exit 1) with
    ``summary.json`` at the true step.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param state: the plugins' checkpoint state: ``{plugin name: JSON value}``.
    """


@hookspec
def on_checkpoint_load(run: RunProtocol, state: dict[str, Any]) -> None:
    """A checkpoint was loaded; ``state`` is the mapping that ``on_checkpoint_save`` filled.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param state: the plugins' checkpoint state: ``{plugin name: JSON-able value}``.
    """


@hookspec
def on_exception(run: RunProtocol, error: BaseException) -> None:
    """The run is stopping on ``error`` (any exception, including ``KeyboardInterrupt``). Clean up here;
    the error propagates after all implementations ran. An implementation that raises is logged
    (``on_exception_failed``, naming the plugin); the others still run and ``error`` is what propagates.

    :param run: the ``Run`` (what it exposes: ``RunProtocol``; its position: ``run.global_step`` ...).
    :param error: the exception that stops the run.
    """

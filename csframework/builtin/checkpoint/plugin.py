"""The checkpoint plugin: save every ``checkpoint.every_steps``, when a stage ends and when a signal stops
the run; keep the newest ``keep_last`` (and the best, ``keep_best``); resume (``checkpoint.resume=auto`` or
a path), falling back to older checkpoints when one is damaged, with a warning naming it.

It writes and reads checkpoints through ``format`` and ``store``; under a sharded backend
(``Backend.sharded``) every rank writes and loads its shards of the model and optimizer through the
backend (``Backend.save_sharded``, ``load_sharded``, ``read_shard_metadata``), so no strategy is named here.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ...errors import (CheckpointWriteError, ConfigError, DamagedCheckpoint, PluginError, UnreadableCheckpoints,
                       UnsafePathError)
from ...files import SafeDir
from ...hooks import as_plugin
from ...hookspecs import hookimpl
from . import store
from .best import BestTracker
from .changes import changed_settings, changes_problem, config_differences
from .format import (MAX_CONFIG_BYTES, MAX_META_BYTES, SHARDED, read_checkpoint, read_config_yaml, temporary_dir,
                     write_checkpoint)
from .schema import StateMismatch, TrainedFurther, checked_state
from .store import INDEX, checkpoint_names, read_best, resume_source, step_of

#: What the plugins' state may take in meta.json (the rest of ``MAX_META_BYTES`` is the files table).
MAX_PLUGIN_STATE_BYTES = MAX_META_BYTES - (1 << 20)



# -- the plugin -----------------------------------------------------------------------------------------
class CheckpointPlugin:
    name = "checkpoint"

    def __init__(self):
        self.saved_step = None
        self.saved_eval_step = -1  # the evaluation (its step) the checkpoint of saved_step holds the metrics of
        self.every: int | None = None  # the stage's checkpoint.every_steps
        self.every_epochs: int | None = None  # the stage's checkpoint.every_epochs
        self.run: Any = None  # the run training (on_train_start), which _due reads
        self.next_every: float = math.inf  # the next step checkpoint.every_steps saves at (_due)
        self.config_yaml: str | None = None  # the run's config as YAML, made at the first save
        self.best = BestTracker()  # keep_best: the best so far, and what was reported when
        self.shards: SafeDir | None = None  # a sharded backend: the temporary directory the ranks write into
        self.monitor_checked = False  # keep_best.monitor compared with what the first evaluation reported

    @staticmethod
    def _root(run) -> Path:
        """The run's ``checkpoints/``: a real directory of the run directory, or absent. Anything else (a
        link to another run's checkpoints, a file) is refused naming it: resuming or pruning through it
        would read or delete what this run does not own."""
        kind = run.files.kind("checkpoints")
        if kind not in (None, "dir"):
            raise UnsafePathError(f"{run.files / 'checkpoints'}: it is a {'symbolic link' if kind == 'link' else kind}"
                                  ", not the run's own checkpoints directory; remove it (csframework never "
                                  "creates one)")
        return run.files / "checkpoints"

    def _config_yaml(self, run) -> str:
        """The run's config as a checkpoint's ``config.yaml`` (made once: a plugin instance serves one run,
        whose config does not change); ``ConfigError`` when resume could not read it back."""
        if self.config_yaml is None:
            text = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(run.config)))
            size = len(text.encode("utf-8"))
            if size > MAX_CONFIG_BYTES:
                sections = {f.name: len(repr(getattr(run.config, f.name))) for f in dataclasses.fields(run.config)}
                largest = max(sections, key=lambda name: sections[name])
                raise ConfigError(f"{largest}: the run's config is {size} bytes as YAML, more than the "
                                  f"{MAX_CONFIG_BYTES} bytes (16 MiB) a checkpoint's config.yaml may hold, so no "
                                  f"checkpoint of this run could be resumed; its largest section is {largest!r} "
                                  f"(about {sections[largest]} bytes): keep large data in files and put their "
                                  "paths in the config")
            self.config_yaml = text
        return self.config_yaml

    @hookimpl(tryfirst=True)
    def on_fit_start(self, run):
        # what a checkpoint could not be read back with is refused before training (the YAML takes
        # tens of ms to make: only for a config whose repr is near the limit, else at the first save)
        if run.rank == 0 and run.mode == "fit" and len(repr(run.config)) > MAX_CONFIG_BYTES // 16:
            self._config_yaml(run)
        if not self.restore(run) and run.mode != "fit" and run.global_step == 0:  # not after a fit
            run.log.warning("validating_initial_weights", resume=run.config.checkpoint.resume,
                            fix="set checkpoint.resume=<a run directory or checkpoint> to evaluate trained weights")
        self.best.forget()  # the index as the restored run left it
        if run.rank == 0:
            self._name_best(run, read_best(self._root(run)))

    @hookimpl
    def on_log_metrics(self, metrics, step):
        self.best.note_reported(metrics, step)

    @hookimpl
    def on_eval_end(self, run, metrics):
        """At the first evaluation, a ``keep_best.monitor`` no metric is named (a typo) is said once; a training
        metric's (``train/*``) at the first evaluation after a log has reported training's metrics."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        if monitor and not self.monitor_checked and (
                not monitor.startswith("train/") or any(name.startswith("train/") for name in run.metrics)):
            self.monitor_checked = True
            if monitor not in metrics and monitor not in run.metrics:
                run.log.warning("keep_best_monitor_not_reported", monitor=monitor,
                                reported=sorted({*metrics, *run.metrics}),
                                fix="set checkpoint.keep_best.monitor to one of the reported metrics; "
                                    "until then no best checkpoint is kept")

    @staticmethod
    def _name_best(run, best: dict | None) -> None:
        if best:
            run.summary_extra["best_checkpoint"] = {"path": f"checkpoints/{best['name']}", "metric": best["metric"],
                                                    "value": best["value"]}
        else:
            run.summary_extra.pop("best_checkpoint", None)

    def restore(self, run) -> bool:
        """Load ``checkpoint.resume`` into ``run``; ``True`` when a checkpoint was loaded."""
        resume = run.config.checkpoint.resume
        if resume == "never":
            return False
        if resume == "auto":
            source, fallback = self._root(run), True
        else:
            source, fallback = resume_source(Path(resume))
        candidates = [source]
        if fallback:
            try:  # this run's index is repaired; another run's is only read
                names = self._checkpoints(run, source, rewrite=resume == "auto")
            except UnreadableCheckpoints as e:
                raise ConfigError(f"checkpoint.resume={resume}: {e}; make it a readable directory, or "
                                  "start afresh in another run directory (hydra.run.dir=...)") from e
            if not names and resume != "auto":
                raise ConfigError(f"checkpoint.resume: no complete checkpoint in {source}")
            if not names and run.mode == "fit":
                run.log.warning("nothing_to_resume", path=str(source),
                                problem=f"checkpoint.resume=auto found no checkpoint in run directory {run.output_dir}: "
                                        "training starts at step 0; to continue an earlier run, give its directory "
                                        "(hydra.run.dir=<its run directory>)")
            candidates = [source / name for name in reversed(names)]
            best = read_best(source) if run.mode in ("test", "predict") else None
            if best is not None:  # test or predict with the best weights a run kept, else its newest
                candidates.sort(key=lambda path: path.name != best["name"])
        damaged = []
        shard_check = run.backend.read_shard_metadata if run.backend.sharded else None
        for path in candidates:
            try:
                state, meta = read_checkpoint(path, shard_check)
                state = checked_state(run, state, f"checkpoint {path}")  # forged values: the config's rules
            except DamagedCheckpoint as e:
                # trained past this config's steps, at the step its name says: a setting to raise, not damage
                # to fall back from (an earlier checkpoint would undo the training this one holds)
                if isinstance(e, TrainedFurther) and store.NAME.fullmatch(path.name) and step_of(path.name) == e.step:
                    raise ConfigError(f"checkpoint {path}: {e.problem}") from e
                if not fallback:
                    raise ConfigError(f"checkpoint.resume: {e}") from e
                run.log.warning("checkpoint_damaged", path=str(path), error=str(e),
                                action="falling back to the previous checkpoint")
                damaged.append(path.name)
                continue
            self._load(run, path, state, meta)
            return True
        if damaged:  # starting over would, at the first save, prune checkpoints someone may still need
            own = os.path.realpath(source) == os.path.realpath(run.output_dir / "checkpoints")
            ways = ("start afresh here with checkpoint.start_over=true (which moves them aside), or in a new run "
                    "directory (hydra.run.dir=...)" if own else
                    "resume another checkpoint, or start afresh without checkpoint.resume")
            raise ConfigError(f"checkpoint.resume={resume}: found {len(damaged)} checkpoint(s) in {source} but "
                              f"could read none ({', '.join(damaged)}; the checkpoint_damaged warnings above say "
                              f"why); {ways}")
        return False

    def _checkpoints(self, run, root: Path, rewrite: bool) -> list[str]:
        """``checkpoint_names(root)``; a wrong index is reported naming it and, with ``rewrite``, rebuilt."""
        names, problem = checkpoint_names(root)
        if problem:
            run.log.warning("checkpoint_index_rebuilt", path=str(root / INDEX), problem=problem,
                            action="using the checkpoint directories found there instead", checkpoints=names)
            if rewrite and run.rank == 0:
                try:
                    store.write_index(root, {"checkpoints": names})
                except (OSError, UnsafePathError) as e:  # the next save reports it; resuming needs none
                    run.log.warning("checkpoint_index_not_rewritten", path=str(root / INDEX),
                                    error=getattr(e, "strerror", None) or str(e))
        return names

    def _load(self, run, path: Path, state: dict, meta: dict) -> None:
        def check_optimizer():
            saved = meta.get("optimizer")
            if saved and saved != type(run.optimizer).__name__:
                raise ConfigError(f"checkpoint {path} does not fit this run: optimizer.name: its state is "
                                  f"{saved}'s, this run uses {type(run.optimizer).__name__}")

        if state["loop"]["stage_index"] == run.stage_index:
            check_optimizer()
        try:
            run.load_state_dict(state)
            if state["sharded"]:  # every rank loads its shards (the backend may reshard to this run's ranks)
                files = {n.split("/", 1)[1] for n in meta["files"] if n.startswith(SHARDED + "/")}
                run.backend.load_sharded(run.model, run.optimizer, path / SHARDED, files)
        except StateMismatch as e:
            why = config_differences(read_config_yaml(path), run.config, "model") if e.field == "model" else []
            raise ConfigError(f"checkpoint {path} does not fit this run: {e.why}"
                              + (f" (config: {'; '.join(why)})" if why else "")) from e
        except (ValueError, KeyError, RuntimeError) as e:  # e.g. an optimizer with other parameter groups
            raise ConfigError(f"checkpoint {path} does not fit this run: {type(e).__name__}: "
                              f"{str(e).splitlines()[0]}") from e
        check_optimizer()  # the stage it was saved in is entered now
        run.metrics.update(meta.get("metrics") or {})
        run.hooks.on_checkpoint_load(run=run, state=meta.get("plugins") or {})
        self.saved_step, self.saved_eval_step = run.global_step, run.last_eval_step
        run.log.info("resumed", path=str(path), step=run.global_step, stage=run.stage)
        if run.mode == "fit":
            changes = changed_settings(read_config_yaml(path), run.stage_config, run.stage)
            if changes:
                run.log.warning("resume_settings_changed", path=str(path),
                                changed=[f"{key}: {then} -> {now}" for key, then, now in changes],
                                problem=changes_problem(run, changes))

    @hookimpl
    def on_train_start(self, run):
        self.every = run.stage_config.checkpoint.every_steps  # read once a stage, not at every step
        self.every_epochs = run.stage_config.checkpoint.every_epochs
        self.run = run
        self.next_every = self._every_after(run.global_step)  # moved on when reached: no division a step
        # the loop asks before the step's hooks and saves after them (no hook of ours at every step); a failure
        # is reported as this plugin's at the step's end, as from a hook
        run.set_save_due(self._due, as_plugin(self.name, "on_train_step_end", functools.partial(self.save, run)))
        if run.rank == 0:  # the run directory's lock is held: no other writer is alive
            store.remove_stale(self._root(run))

    def _due(self, step: int) -> bool:
        """Whether a checkpoint is saved at ``step`` (``Run.set_save_due``: the loop asks once a step, before
        its hooks, and reports the metrics not yet logged when it is); the loop calls ``save`` after the step's
        ``on_train_step_end`` hooks."""
        run = self.run
        if step >= self.next_every:  # checkpoint.every_steps: one comparison a step, the next such step known
            self.next_every = self._every_after(step)
            due = True
        else:
            # keep_best: an evaluation that improved on the best is saved now, whatever every_steps says (asked
            # on every rank: a sharded save needs them all; the index is read only at an evaluation's step)
            due = run.stopping or bool(self.every_epochs and run.closes_epochs(self.every_epochs)) \
                or (run.last_eval_step == step and self.best.evaluation_improved(run, self._root(run)))
        return due

    def _every_after(self, step: int) -> float:
        """The first step after ``step`` that ``checkpoint.every_steps`` saves at (infinity without it)."""
        return (step // self.every + 1) * self.every if self.every else math.inf

    @hookimpl
    def on_train_end(self, run):
        if self.saved_step != run.global_step:
            if run.stage_config.checkpoint.save_at_end:
                self.save(run)
        elif self.saved_eval_step != run.last_eval_step:
            # the final evaluation came after this step's checkpoint (a stop requested after the step's
            # evaluation, in on_train_batch_end or on_train_step_end): written again, so that it holds that
            # evaluation's metrics (and keep_best can choose it)
            self.save(run)

    def save(self, run) -> Path | None:
        """Write a checkpoint of ``run`` now (rank 0; under a sharded backend every rank writes its shards
        first) and prune to ``keep_last``.

        Refuses (``NonFiniteLossError``) when the run has gone non-finite, so the last good checkpoint is never
        replaced by a non-finite state: the loop reported (and so checked) the losses not yet logged before
        the step's hooks (``Run.set_save_due``); the parameters and the loss scale are checked here.
        """
        sharded = run.backend.sharded
        if run.rank != 0 and not sharded:
            return None
        run.check_finite()
        root = self._root(run)
        run.files.sub("checkpoints")
        name = f"step-{run.global_step:08d}"
        if sharded:  # every rank writes its shards into rank 0's temporary directory, then rank 0
            self._write_shards(run, root, name)  # completes the checkpoint and says whether it committed
            if run.rank != 0:
                error = run.backend.broadcast(None)
                if error:
                    raise CheckpointWriteError(f"checkpoint: rank 0 failed to complete it: {error}")
                self.best.recorded(self.best.best_after_saving(run, root, name))  # as rank 0 indexed it
                self.saved_step, self.saved_eval_step = run.global_step, run.last_eval_step
                return None
            try:
                path = self._complete(run, root, name, sharded)
            except BaseException as e:
                run.backend.broadcast(f"{type(e).__name__}: {e}")
                raise
            run.backend.broadcast(None)
            return path
        return self._complete(run, root, name, sharded)

    def _write_shards(self, run, root: Path, name: str) -> None:
        """Every rank: write this rank's shards of the model and optimizer into rank 0's temporary directory."""
        where = None
        if run.rank == 0:
            try:
                self.shards = temporary_dir(root, name)
                where = str(self.shards.sub(SHARDED).path)
            except OSError:
                pass
        where = run.backend.broadcast(where)  # also a barrier: the directory exists from here on
        if where is None:
            raise CheckpointWriteError(f"checkpoint: could not create a temporary directory in {root}; the "
                                       "previous checkpoints are intact")
        run.backend.save_sharded(run.model, run.optimizer, Path(where))

    def _complete(self, run, root: Path, name: str, sharded: bool) -> Path:
        """Rank 0: write the checkpoint (around the shards, if ``sharded``), index it, prune to keep_last."""
        plugin_state = plugin_checkpoint_state(run)
        meta = {"stage": run.stage, "plugins": plugin_state,
                "metrics": dict(run.metrics), "run_id": run.run_id, "optimizer": type(run.optimizer).__name__}
        path = write_checkpoint(root, name, run.state_dict(), meta, self._config_yaml(run),
                                sharded=self.shards if sharded else None)
        self.shards = None
        kept = [n for n in self._checkpoints(run, root, rewrite=False) if n != name] + [name]
        retained = kept[-run.stage_config.checkpoint.keep_last:]
        best = self.best.best_after_saving(run, root, name)
        index: dict = {"checkpoints": retained}
        if best:  # kept besides keep_last
            index["checkpoints"] = retained = sorted(set(retained) | {best["name"]}, key=step_of)
            index["best"] = best
        try:
            store.write_index(root, index)
        except (OSError, UnsafePathError) as e:
            raise CheckpointWriteError(f"checkpoint: could not update {root / INDEX} "
                                       f"({getattr(e, 'strerror', None) or e}); "
                                       f"{path} is complete and the previous checkpoints are intact") from e
        for old in kept:
            if old not in retained:
                store.remove_checkpoint(root, old)
        self.best.recorded(best)
        self._name_best(run, best)
        self.saved_step, self.saved_eval_step = run.global_step, run.last_eval_step
        run.log.info("checkpoint_saved", path=str(path))
        return path


def plugin_checkpoint_state(run) -> dict:
    """The ``on_checkpoint_save`` state, checked after each implementation's call: a value that JSON cannot
    hold is a ``PluginError`` naming the plugin whose call put it there and where it is, raised before
    anything is written (the run fails; the previous checkpoints stay complete and indexed). NaN and
    infinities are allowed: Python's ``json`` writes and reads them back (``best = float("inf")``)."""
    state: dict = {}
    for plugin, _ in run.hooks.each("on_checkpoint_save", run=run, state=state):
        problem = json_problem(state, "state")
        if problem:
            raise PluginError(plugin, "on_checkpoint_save", TypeError(
                f"{problem}: put only JSON values (dicts with string keys, lists, strings, numbers, booleans, "
                f"None) into the state; no checkpoint of step {run.global_step} was written, the previous "
                "checkpoints are intact"))
        size = len(json.dumps(state))
        if size > MAX_PLUGIN_STATE_BYTES:  # else meta.json would be too large for resume to read back
            raise PluginError(plugin, "on_checkpoint_save", ValueError(
                f"the plugins' checkpoint state is {size} bytes as JSON, more than the {MAX_PLUGIN_STATE_BYTES} "
                f"bytes a checkpoint's meta.json keeps for it; keep large data in files of its own; no "
                f"checkpoint of step {run.global_step} was written, the previous checkpoints are intact"))
    return state


def json_problem(value, where: str, _path: tuple = ()) -> str | None:
    """``None`` if ``json.dumps`` can write ``value``, else which part of it cannot (``state['a'][2] is of
    type Tensor ...``)."""
    if id(value) in _path:
        return f"{where} refers back to itself (a circular reference)"
    try:
        json.dumps(value)
        return None
    except (TypeError, ValueError, RecursionError):
        pass
    path = _path + (id(value),)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{where} has a key of type {type(key).__name__} ({key!r:.40})"
            found = json_problem(item, f"{where}[{key!r}]", path)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = json_problem(item, f"{where}[{i}]", path)
            if found:
                return found
    return f"{where} is of type {type(value).__name__} ({value!r:.40})"

"""The checkpoint plugin: save every ``checkpoint.every_steps``, when a stage ends and when a signal stops
the run; keep the newest ``keep_last`` (and the best, ``keep_best``); resume (``checkpoint.resume=auto`` or
a path), falling back to older checkpoints when one is damaged, with a warning naming it.

It writes and reads checkpoints through ``format`` and ``store``; under a sharded backend
(``Backend.sharded``) every rank writes and loads its shards of the model and optimizer through the
backend (``Backend.save_sharded``, ``load_sharded``, ``read_shard_metadata``), so no strategy is named here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

import torch
from omegaconf import OmegaConf

from ...errors import (CheckpointWriteError, ConfigError, DamagedCheckpoint, PluginError, UnreadableCheckpoints,
                       UnsafePathError)
from ...files import SafeDir
from ...hookspecs import hookimpl
from ...schedule import Schedule, lr_factor
from . import store
from .best import BestTracker
from .format import (MAX_CONFIG_BYTES, MAX_META_BYTES, SHARDED, read_checkpoint, read_config_yaml, temporary_dir,
                     write_checkpoint)
from .readback import state_problem
from .store import INDEX, checkpoint_names, read_best, resume_source, step_of

#: What the plugins' state may take in meta.json (the rest of ``MAX_META_BYTES`` is the files table).
MAX_PLUGIN_STATE_BYTES = MAX_META_BYTES - (1 << 20)



# -- compatibility --------------------------------------------------------------------------------------
def _flatten(node, prefix: str) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: node}


def _config_differences(saved_yaml: str, config, section: str) -> list[str]:
    try:
        saved = cast(dict, OmegaConf.to_container(OmegaConf.create(saved_yaml or "{}"))).get(section)
    except Exception:  # noqa: BLE001 - a config we cannot read names nothing
        return []
    now = cast(dict, OmegaConf.to_container(OmegaConf.structured(config))).get(section)
    before, after = _flatten(saved, section), _flatten(now, section)
    return [f"{key} is {before.get(key, '(unset)')} in the checkpoint, {after.get(key, '(unset)')} now"
            for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


#: What a resumed stage takes from its checkpoint, not from the config: the optimizer's settings (torch's
#: ``load_state_dict`` restores them with its state) and the learning-rate schedule (``Schedule``'s plan, a
#: torch scheduler's own state), planned for the stage's length then (``loop.max_steps``/``max_epochs``).
RESUMED_SETTINGS = ("loop.max_steps", "loop.max_epochs", "optimizer.lr", "optimizer.weight_decay",
                    "optimizer.momentum", "optimizer.nesterov", "optimizer.betas", "optimizer.eps",
                    "optimizer.schedule.")
LENGTH = ("loop.max_steps", "loop.max_epochs")


def changed_settings(saved_yaml: str, config, stage: str) -> list[tuple[str, object, object]]:
    """``(key, in the checkpoint, now)`` for each of ``RESUMED_SETTINGS`` whose value for stage ``stage`` in
    the checkpoint's config (``saved_yaml``) is not its value in ``config`` (the stage's config now). A
    key the checkpoint's config lacks (an older csframework's) is left out, as is a config it cannot read."""
    try:
        saved = cast(dict, OmegaConf.to_container(OmegaConf.create(saved_yaml or "{}")))
        partial = (saved.get("stages") or {}).get(stage) or {}
        before = {}
        for section in ("loop", "optimizer"):
            merged = OmegaConf.merge(saved.get(section) or {}, partial.get(section) or {})
            before.update(_flatten(OmegaConf.to_container(merged), section))
    except Exception:  # noqa: BLE001 - a config we cannot read names nothing
        return []
    now = cast(dict, OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True))
    after = {**_flatten(now["loop"], "loop"), **_flatten(now["optimizer"], "optimizer")}
    return [(key, before[key], after[key]) for key in sorted(set(before) & set(after))
            if key.startswith(RESUMED_SETTINGS) and key != "optimizer.schedule.interval"
            and before[key] != after[key]]


def model_mismatch(model: torch.nn.Module, saved: dict) -> list[str]:
    """How ``saved`` (a model state dict) does not fit ``model``: missing, unexpected or reshaped tensors."""
    current = model.state_dict()
    problems = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"the model has {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                        + " which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint has {unexpected[0]}"
                        + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else "") + " which the model lacks")
    for key, value in current.items():
        if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape):
            problems.append(f"{key} is {list(saved[key].shape)} in the checkpoint, {list(value.shape)} in the model")
            break
    return problems


def _changes_problem(run, changes: list[tuple[str, object, object]]) -> str:
    """What the settings changed since a resumed stage's checkpoint mean, in one line: the schedule and the
    optimizer's settings go on as saved; a longer stage trains on at the schedule's final rate."""
    text = (f"resuming at step {run.global_step} continues the checkpoint's learning-rate schedule and "
            "optimizer settings")
    sched = run.scheduler
    if any(key in LENGTH for key, _, _ in changes) and isinstance(sched, Schedule):
        offset, planned = run.global_step - run.stage_step, sched.total_steps
        end = offset + run.total_steps(run.stage_config)
        if end > offset + planned:
            final = sched.base_lrs[0] * lr_factor(max(planned - 1, 0), sched.cfg, planned)
            text += (f"; the schedule was planned for {planned} steps, so from step {offset + planned} to {end} "
                     f"the rate stays at its final {final:.3g}")
        else:
            text += f"; the schedule was planned for {planned} steps, so training stops at step {end}, before its end"
    others = [key for key, _, _ in changes if key not in LENGTH]
    if others:
        text += (f"; {', '.join(others)} keep{'s' if len(others) == 1 else ''} the checkpoint's "
                 f"value{'' if len(others) == 1 else 's'}")
    return text + "; start a new run for a schedule over the new settings"


# -- the plugin -----------------------------------------------------------------------------------------
class CheckpointPlugin:
    name = "checkpoint"

    def __init__(self):
        self.saved_step = None
        self.saved_eval_step = -1  # the evaluation (its step) the checkpoint of saved_step holds the metrics of
        self.every: int | None = None  # the stage's checkpoint.every_steps
        self.every_epochs: int | None = None  # the stage's checkpoint.every_epochs
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
        """At the first evaluation, a ``keep_best.monitor`` no metric is named (a typo) is said once."""
        monitor = run.stage_config.checkpoint.keep_best.monitor
        if monitor and not self.monitor_checked:
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
                problem = state_problem(run, state)
                if problem:  # forged or damaged values: what the config itself would refuse
                    raise DamagedCheckpoint(f"checkpoint {path}: state.pt holds values this run's config refuses "
                                            f"({problem})")
            except DamagedCheckpoint as e:
                if not fallback:
                    raise ConfigError(f"checkpoint.resume: {e}") from e
                run.log.warning("checkpoint_damaged", path=str(path), error=str(e),
                                action="falling back to the previous checkpoint")
                damaged.append(path.name)
                continue
            self._load(run, path, state, meta)
            return True
        if damaged:  # starting over would, at the first save, prune checkpoints someone may still need
            raise ConfigError(f"checkpoint.resume={resume}: found {len(damaged)} checkpoint(s) in {source} but "
                              f"could read none ({', '.join(damaged)}; events.jsonl says why); start afresh "
                              "here with checkpoint.start_over=true (which moves them aside), or in a new run "
                              "directory (hydra.run.dir=...)")
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
        sharded = bool(state.get("sharded"))
        if sharded != run.backend.sharded:
            raise ConfigError(f"checkpoint {path} does not fit this run: it was written "
                              f"{'sharded (strategy=fsdp)' if sharded else 'whole (strategy single or ddp)'}; "
                              "resume it with the same kind of strategy")
        problems = [] if sharded else model_mismatch(run.model, state["model"])
        if problems:
            why = _config_differences(read_config_yaml(path), run.config, "model")
            raise ConfigError(f"checkpoint {path} does not fit this run: {'; '.join(problems)}"
                              + (f" (config: {'; '.join(why)})" if why else ""))
        def check_optimizer():
            saved = meta.get("optimizer")
            if saved and saved != type(run.optimizer).__name__:
                raise ConfigError(f"checkpoint {path} does not fit this run: optimizer.name: its state is "
                                  f"{saved}'s, this run uses {type(run.optimizer).__name__}")

        if state["loop"].get("stage_index") == run.stage_index:
            check_optimizer()
        try:
            run.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:  # e.g. an optimizer with other parameter groups
            raise ConfigError(f"checkpoint {path} does not fit this run: {type(e).__name__}: "
                              f"{str(e).splitlines()[0]}") from e
        if sharded:  # every rank loads its shards (the backend may reshard to this run's number of ranks)
            try:
                files = {n.split("/", 1)[1] for n in meta["files"] if n.startswith(SHARDED + "/")}
                run.backend.load_sharded(run.model, run.optimizer, path / SHARDED, files)
            except (ValueError, KeyError, RuntimeError) as e:
                raise ConfigError(f"checkpoint {path} does not fit this run: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}") from e
        check_optimizer()  # the stage it was saved in is entered now
        run.metrics.update(meta.get("metrics") or {})
        run.hooks.on_checkpoint_load(run=run, state=meta.get("plugins") or {})
        self.saved_step, self.saved_eval_step = run.global_step, run.state.last_eval_step
        run.log.info("resumed", path=str(path), step=run.global_step, stage=run.stage)
        if run.mode == "fit":
            changes = changed_settings(read_config_yaml(path), run.stage_config, run.stage)
            if changes:
                run.log.warning("resume_settings_changed", path=str(path),
                                changed=[f"{key}: {then} -> {now}" for key, then, now in changes],
                                problem=_changes_problem(run, changes))

    @hookimpl
    def on_train_start(self, run):
        self.every = run.stage_config.checkpoint.every_steps  # read once a stage, not at every step
        self.every_epochs = run.stage_config.checkpoint.every_epochs
        if run.rank == 0:  # the run directory's lock is held: no other writer is alive
            store.remove_stale(self._root(run))

    @hookimpl(trylast=True)
    def on_train_step_end(self, run, step):
        # checkpoint.every_epochs (asked first: no call at every step without it)
        by_epochs = bool(self.every_epochs) and run.state.closes_epochs(self.every_epochs)
        # keep_best: an evaluation that improved on the best is saved now, whatever every_steps says (asked
        # on every rank: a sharded save needs them all; the index is read only at an evaluation's step)
        if run.state.stopping or (self.every and step % self.every == 0) or by_epochs \
                or (run.state.last_eval_step == step and self.best.evaluation_improved(run, self._root(run))):
            self.save(run)

    @hookimpl
    def on_train_end(self, run):
        if self.saved_step != run.global_step:
            if run.stage_config.checkpoint.save_at_end:
                self.save(run)
        elif self.saved_eval_step != run.state.last_eval_step:
            # the final evaluation came after this step's checkpoint (a stop requested after the step's
            # evaluation, in on_train_batch_end or on_train_step_end): written again, so that it holds that
            # evaluation's metrics (and keep_best can choose it)
            self.save(run)

    def save(self, run) -> Path | None:
        """Write a checkpoint of ``run`` now (rank 0; under a sharded backend every rank writes its shards
        first) and prune to ``keep_last``.

        Refuses (``NonFiniteLossError``) when the run has gone non-finite since the last log, so the last
        good checkpoint is never replaced by a non-finite state.
        """
        sharded = run.backend.sharded
        if run.rank != 0 and not sharded:
            return None
        run.flush_metrics()
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
                self.saved_step, self.saved_eval_step = run.global_step, run.state.last_eval_step
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
        meta = {"global_step": run.global_step, "stage": run.stage, "plugins": plugin_state,
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
        self.saved_step, self.saved_eval_step = run.global_step, run.state.last_eval_step
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

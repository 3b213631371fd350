"""The test sets (``data.test``, ``data.test_sets``): each evaluated whole, once, after training with the
best checkpoint's weights (``checkpoint.keep_best``; else the last ones), or by ``mode=test`` with the
weights ``checkpoint.resume`` restored. Their metrics (``test/loss`` ...) are reported as any other, so
they reach ``metrics.csv``, ``summary.json`` and the run's end line.

A test pass fires the per-set evaluation hooks (``on_eval_epoch_start``, ``on_eval_batch_start``/``_end``,
``on_eval_epoch_end``, with ``run.eval_set`` the test set's name), not ``on_eval_start``/``on_eval_end``:
those belong to training's evaluations, where plugins (early stopping, keep_best) act on them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config.sections import test_set_key, test_sets
from .data import build_loader, is_iterable
from .errors import CheckpointNotFound, ConfigError, DamagedCheckpoint
from .rng import rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from .protocol import LoopRun


def has_test_sets(run: LoopRun) -> bool:
    return bool(test_sets(run.stage_config.data))


def test_pass(run: LoopRun) -> dict[str, float]:
    """Evaluate every test set whole; returns (and reports) ``<set>/*``, the means over samples of every
    scalar output. Training's random generators are left as they were (as ``evaluation.evaluate`` does)."""
    from .evaluation import evaluate_set

    cfg = run.stage_config
    metrics: dict[str, float] = {}
    training_rng = rng_state()
    seed_everything(((cfg.seed * 1_000_003 + run.global_step) * 1_000_003 + 11) % 2**63)
    was_training = run.module.training
    run.module.eval()
    try:
        for name in test_sets(cfg.data):
            loader, dataset = build_loader(cfg.data, name, cfg.seed, rank=run.rank, world_size=run.world_size,
                                           device_type=cfg.device.type)
            if not is_iterable(loader) and len(dataset) == 0:
                raise ConfigError(f"{test_set_key(cfg.data, name)}: the dataset is empty ({type(dataset).__name__} "
                                  "has no sample); check it")
            try:
                run.eval_set = name
                metrics.update(evaluate_set(run, name, loader, None, whole=True))
            finally:
                loader.close()
    finally:
        run.eval_set = None
        set_rng_state(training_rng)
        run.module.train(was_training)
    run.report(metrics)
    return metrics


def test_after_fit(run: LoopRun) -> dict[str, float]:
    """The test pass at the end of a fit, with the best checkpoint's weights loaded into ``run.model`` when
    ``checkpoint.keep_best`` kept one (they stay loaded: the model ends with the weights it was tested
    with, as Hugging Face's ``load_best_model_at_end``); ``summary.json`` names them as ``tested_weights``."""
    weights = _load_best(run)
    run.summary_extra["tested_weights"] = weights
    metrics = test_pass(run)
    run.log.info("tested", weights=weights, **metrics)
    return metrics


def _load_best(run: LoopRun) -> str:
    """Load the run directory's best checkpoint into ``run.model``; returns what the model holds then: that
    checkpoint's path in the run directory, or ``last`` (no best kept, or a sharded model, which the
    checkpoint's whole weights cannot be loaded into here)."""
    from .weights import load_checkpoint

    if not run.stage_config.checkpoint.keep_best.monitor:
        return "last"
    if run.backend.sharded:
        run.log.warning("tested_with_last_weights", problem="a sharded model is tested with its last weights, "
                        "not the best checkpoint's", fix="test the best checkpoint with mode=test "
                        f"checkpoint.resume={run.output_dir}")
        return "last"
    try:
        best = load_checkpoint(run.output_dir, which="best")
    except CheckpointNotFound:  # nothing was evaluated after keep_best began, say
        return "last"
    except DamagedCheckpoint as e:  # the test still runs, on weights it names; the damage is reported
        run.log.warning("tested_with_last_weights", problem=f"the best checkpoint is unreadable: {e}",
                        fix="test another checkpoint with mode=test checkpoint.resume=<its directory>")
        return "last"
    run.model.load_state_dict(best.model)
    return f"checkpoints/{best.path.name}"

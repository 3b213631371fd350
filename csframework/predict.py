"""``mode=predict``: the model's outputs for every sample of ``data.predict``, written to
``predictions.jsonl`` in the run directory (through the safe file layer, replaced atomically).

One JSON object a line, one line a sample, in the dataset's order: ``index`` (the sample's index in the
dataset) and each per-sample output ``forward`` returned (a tensor whose first dimension is the batch's),
as a number or a (nested) list; ``loss`` and outputs of another shape (a batch's mean) are left out.
``csframework.models.Supervised`` returns ``preds`` (the predicted classes, or a regression's values) and
``logits``."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from .data import PREDICT, build_loader
from .errors import ConfigError
from .jsonout import dumps
from .batched import samples_in

if TYPE_CHECKING:
    from .protocol import LoopRun

#: The file ``mode=predict`` writes in the run directory.
PREDICTIONS = "predictions.jsonl"


def predict_pass(run: LoopRun) -> dict:
    """Write ``predictions.jsonl`` for ``data.predict``; returns ``{"path", "rows", "outputs"}``, which
    ``summary.json`` holds as ``predictions``."""
    if run.world_size > 1:
        raise ConfigError("mode=predict: run it in one process (not under torchrun): the rows are written "
                          "in the dataset's order by one writer")
    cfg = run.stage_config
    loader, _ = build_loader(cfg.data, PREDICT, cfg.seed, device_type=cfg.device.type)
    rows, keys = 0, None
    was_training = run.module.training
    run.module.eval()
    carried = run.state.carried  # a stateful model: the pass starts from initial_state, the state carried on
    try:
        with run.files.atomic(PREDICTIONS) as out, torch.inference_mode(), \
                carried.evaluating() if carried is not None else contextlib.nullcontext():
            for batch in loader:
                batch = run.backend.to_device(batch)
                outputs = run.module(batch) if carried is None else carried.forward(run.module, batch, checked=False)
                if not isinstance(outputs, dict):
                    outputs = {"output": outputs}
                count = samples_in(batch) or 1
                per_sample = {k: v.detach().cpu() for k, v in outputs.items() if k != "loss"
                              and isinstance(v, torch.Tensor) and v.ndim >= 1 and len(v) == count}
                if not per_sample:
                    raise ConfigError(f"data.predict: the model's forward returned no per-sample output (it "
                                      f"returned {', '.join(sorted(outputs)) or 'nothing'}); return e.g. "
                                      "'preds' with one row per sample")
                keys = keys or sorted(per_sample)
                lines = [dumps({"index": rows + i, **{k: v[i].tolist() for k, v in per_sample.items()}},
                               where=PREDICTIONS) for i in range(count)]
                out.write(("\n".join(lines) + "\n").encode("utf-8"))
                rows += count
    finally:
        loader.close()
        run.module.train(was_training)
    written = {"path": PREDICTIONS, "rows": rows, "outputs": keys or []}
    run.log.info("predictions_written", **written)
    run.summary_extra["predictions"] = written
    return written

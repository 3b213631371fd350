"""The example's second plugin: whole-validation-set accuracy and the confusion matrix, computed from the
predictions and labels the output collector gathered (``loop.collect=[preds,labels]``), not from per-batch
means. Under torchrun the collected outputs are complete on global rank 0, the one that writes.

Enable it with ``plugins.enable=[whole_set:WholeSet] 'loop.collect=[preds,labels]'``; it writes
``confusion.json`` (the matrix of the last evaluation: rows true classes, columns predictions).
"""
from __future__ import annotations

import json

import torch

import csframework as csf


class WholeSet:
    name = "whole_set"

    @csf.hookimpl
    def on_eval_end(self, run, metrics):
        outputs = run.eval_outputs
        if run.rank != 0 or "preds" not in outputs:
            return
        preds, labels = outputs["preds"], outputs["labels"]
        classes = int(max(preds.max(), labels.max())) + 1
        confusion = torch.bincount(labels * classes + preds, minlength=classes * classes).view(classes, classes)
        accuracy = float(confusion.diagonal().sum()) / len(labels)
        run.report({"val/whole_set_accuracy": accuracy})
        run.log.info("whole_set", samples=len(labels), accuracy=round(accuracy, 4))
        report = {"step": run.global_step, "samples": len(labels), "accuracy": accuracy,
                  "confusion": confusion.tolist()}
        (run.output_dir / "confusion.json").write_text(json.dumps(report, indent=2) + "\n")

"""scikit-learn's ``Ridge`` on the example's split, against a csframework run: ``python ridge.py [RUN_DIR]``
prints Ridge's validation MSE, MAE and R², then, given a run directory, the same for the run's best
checkpoint (``csf.load_model``), scored by scikit-learn on the same rows."""
from __future__ import annotations

import sys

import torch
from sklearn.linear_model import Ridge
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from diabetes import split


def scores(name: str, y_val, predicted) -> str:
    return (f"{name:<12} val MSE {mean_squared_error(y_val, predicted):.1f}  "
            f"MAE {mean_absolute_error(y_val, predicted):.2f}  R2 {r2_score(y_val, predicted):.4f}")


def main(argv: list[str]) -> int:
    x_train, x_val, y_train, y_val = split()
    print(scores("Ridge:", y_val, Ridge().fit(x_train, y_train).predict(x_val)))
    if argv:
        import csframework as csf

        try:
            model = csf.load_model(argv[0], which="best")
        except Exception as error:  # a missing, damaged or foreign run directory: one line, no traceback
            print(f"ridge.py: {argv[0]}: {error}", file=sys.stderr)
            return 2
        with torch.no_grad():
            predicted = model(torch.tensor(x_val, dtype=torch.float32))["preds"].numpy()
        print(scores("csframework:", y_val, predicted) + f"  (best checkpoint of {argv[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

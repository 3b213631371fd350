"""scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression score one year
later; no download) as torch datasets, split as ``ridge.py`` splits it for scikit-learn's ``Ridge``, and a
small MLP for it."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

#: The split this example and ridge.py share: 20% held out for validation, drawn with this seed.
VAL_SIZE, SPLIT_SEED = 0.2, 0


def split():
    """``(x_train, x_val, y_train, y_val)``, the features standardised with the training rows' mean and
    standard deviation (the targets as they are: the MSE is in the score's own units)."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=VAL_SIZE, random_state=SPLIT_SEED)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    return (x_train - mean) / std, (x_val - mean) / std, y_train, y_val


def diabetes(split_name: str = "train", targets: bool = True) -> TensorDataset:
    """The ``train`` or ``val`` rows as ``(features, score)`` samples; with ``targets=false`` the features
    alone (a ``data.predict`` set)."""
    if split_name not in ("train", "val"):
        raise ValueError(f"split_name must be 'train' or 'val', got {split_name!r}")
    x_train, x_val, y_train, y_val = split()
    x, y = (x_train, y_train) if split_name == "train" else (x_val, y_val)
    features = torch.tensor(x, dtype=torch.float32)
    return TensorDataset(features, torch.tensor(y, dtype=torch.float32)) if targets else TensorDataset(features)


def mlp(hidden: int = 32, start: float = 150.0) -> nn.Module:
    """10 features -> ``hidden`` -> 1 score; the output bias starts at ``start`` (about the scores' mean, so
    the first steps fit the features, not the offset)."""
    net = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    nn.init.constant_(net[2].bias, start)
    return net

"""scikit-learn's bundled handwritten digits (1,797 8x8 images, no download) as torch datasets, split as
``reference.py`` splits them for scikit-learn's own ``MLPClassifier``, and a small MLP for them."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

#: The split both this example and reference.py use: 20% held out, stratified, drawn with this seed.
TEST_SIZE, SPLIT_SEED = 0.2, 0


def split():
    """``(x_train, x_val, y_train, y_val)``: pixel values scaled to [0, 1] (they are 0..16)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    return train_test_split(x / 16.0, y, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=y)


def digits(split_name: str = "train") -> TensorDataset:
    """The ``train`` or ``val`` part of the split as ``(image, label)`` samples."""
    x_train, x_val, y_train, y_val = split()
    x, y = (x_train, y_train) if split_name == "train" else (x_val, y_val)
    return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))


def mlp(hidden: int = 128, dropout: float = 0.1) -> nn.Module:
    """64 pixels -> ``hidden`` -> 10 classes."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))

"""`digits`: the 1797 8x8 handwritten digits (UCI) that scikit-learn ships in its package.

Read straight from `sklearn/datasets/data/digits.csv.gz` (64 pixel values 0-16, then the
label), without importing scikit-learn. 80% train / 20% held out by a fixed permutation that
does not depend on --seed, so every run is scored on the same 360 images.
"""

from __future__ import annotations

import numpy as np
import torch

from plait.train.data.base import Classification
from plait.train.data.extras import digits_csv

SPLIT_SEED = 20240601  # fixed: the held-out set is the same for every --seed
TRAIN_FRACTION = 0.8


def load(*, task: str = "classify", block_size: int = 0) -> Classification:
    """The digits as (samples, 1, 8, 8) images, standardised with the train set's statistics."""
    raw = np.loadtxt(digits_csv(), delimiter=",", dtype=np.float32)  # (1797, 65)
    x = torch.from_numpy(raw[:, :64].copy()).view(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(raw[:, 64].astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_train = int(len(y) * TRAIN_FRACTION)
    train, val = order[:n_train], order[n_train:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Classification(
        name="digits",
        x_train=x[train],
        y_train=y[train],
        x_val=x[val],
        y_val=y[val],
        num_classes=10,
    )

"""Bring your own model and data to `plait train`: a small classifier on data made here.

    plait train --workload examples.custom_workload:make --workers 2 --dp 2
    plait train --workload examples.custom_workload:make --workers 2 --strategy ps --servers 1
    plait train --workload examples.custom_workload:make --workers 2 --pp 2
    python examples/custom_workload.py           # the first of these, from Python

(from the repository root; a path works too: --workload examples/custom_workload.py:make).

A `Workload` names four things: a model builder, called under a fixed seed so that every
rank starts from the same weights; the data, train and held-out (`TensorData` holds
tensors; any object with num_train, num_val, train_batch and val_batch will do); the loss;
and the held-out metric. Every strategy then trains it: data parallelism and the parameter
server take any model, and a pipeline (--pp) cuts the model into stages, which is why
`model()` returns an `nn.Sequential`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from plait.train import ACCURACY, TensorData, Workload

DIM, CLASSES = 16, 4
N_TRAIN, N_VAL = 2048, 512
DATA_SEED = 7  # the data is the same in every process: it is made from this seed


def blobs() -> TensorData:
    """Gaussian blobs: samples (DIM,) around CLASSES random centres, labelled by centre."""
    g = torch.Generator().manual_seed(DATA_SEED)
    centres = 0.5 * torch.randn(CLASSES, DIM, generator=g)  # (classes, dim): they overlap
    y = torch.randint(0, CLASSES, (N_TRAIN + N_VAL,), generator=g)  # (samples,)
    x = centres[y] + torch.randn(N_TRAIN + N_VAL, DIM, generator=g)  # (samples, dim)
    return TensorData("blobs", x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:])


def model() -> nn.Sequential:
    """(batch, DIM) -> (batch, CLASSES) logits; a sequence of layers, so --pp can cut it."""
    return nn.Sequential(
        nn.Linear(DIM, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def make() -> Workload:
    """What `plait train --workload examples.custom_workload:make` trains."""
    return Workload(name="blobs-mlp", model=model, data=blobs(), loss=F.cross_entropy,
                    metric=ACCURACY)  # fmt: skip


if __name__ == "__main__":
    from plait.train import job

    sys.exit(job.run({"workload": f"{__file__}:make", "workers": 2, "steps": 60}))

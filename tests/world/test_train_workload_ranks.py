"""The user's own workload (examples/custom_workload.py) in one world of 2 ranks, under data
parallelism and a 2-stage pipeline (`battery`), against a single-process reference that
rank 0 computes with plain torch (the recipe of a custom workload: SGD, momentum 0.9,
Nesterov, constant lr here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait import Communicator
from plait.train.config import TrainConfig
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.loop import train
from plait.train.workload import Workload, load
from support.paths import EXAMPLES
from support.world import run_world

EXAMPLE = f"{EXAMPLES / 'custom_workload.py'}:make"


ENV = {"PLAIT_TIMEOUT": "60"}


RUN = {"workload": EXAMPLE, "steps": 8, "batch_size": 32, "lr_decay": "none",
       "eval_every": 0, "log_every": 4}  # fmt: skip


SHAPES = {"dp": {"dp": 2}, "pp": {"pp": 2, "chunks": 2}}


LR = 0.05  # recipes.CUSTOM


def reference(work: Workload, steps: int, batch: int) -> dict[str, Any]:
    """One process, plain torch: the custom recipe's SGD on every step's whole global batch."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = work.model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True)
    sampler = GlobalBatchSampler(work.data.num_train, batch, 0)
    losses = []
    for step in range(steps):
        x, y = work.data.train_batch(sampler.indices(step))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = work.data.val_batch(torch.arange(work.data.num_val))
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=-1) == y).double().mean().item()
    return {"losses": losses, "eval_value": accuracy}


def battery(comm: Communicator) -> dict[str, Any]:
    work = load(EXAMPLE)
    results: dict[str, Any] = {}
    if comm.rank == 0:
        results["one"] = reference(work, RUN["steps"], RUN["batch_size"])  # type: ignore[arg-type]
    for name, shape in SHAPES.items():
        config = TrainConfig.from_options({**RUN, **shape, "workers": comm.size})
        results[name] = train(config, comm, workload=work).figures()
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_world(2, battery, timeout=200, env=ENV)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_example_trains_like_one_process(two_ranks: list[dict[str, Any]], shape: str) -> None:
    one, got = two_ranks[0]["one"], two_ranks[0][shape]
    assert (got["model"], got["data"], got["steps"]) == ("blobs-mlp", "blobs", RUN["steps"])
    torch.testing.assert_close(got["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    assert abs(got["eval_value"] - one["eval_value"]) <= 1 / 512  # one held-out sample
    assert two_ranks[1][shape]["losses"] == got["losses"]
    if shape == "pp":  # a pipeline of two stages over both ranks, not data parallelism
        assert (got["dp"], got["pp"], got["peak_activations"]) == (1, 2, [2, 1])

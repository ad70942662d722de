"""The profile times the optimizer as `plait train` runs it: the recipe's weight decay, and
the workers' allocator (issue 36's finding: wide's step was profiled at 4.8 ms and ran 8)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from plait.plan import profile as profiling
from plait.train import optimizers
from plait.train.recipes import CUSTOM, RECIPES
from plait.train.workloads import builtin


def test_the_optimizer_is_timed_with_the_recipes_weight_decay(monkeypatch):
    assert (
        profiling._weight_decay(builtin("wide"), "sgd")
        == RECIPES["wide"].rates["sgd"].weight_decay
        > 0
    )
    assert profiling._weight_decay(builtin("gpt"), "adamw") == 0.01
    other = replace(builtin("wide"), name="mine.py:build")  # a workload of one's own
    assert profiling._weight_decay(other, "sgd") == CUSTOM.rates["sgd"].weight_decay
    given = []
    sgd = optimizers.MAKERS["sgd"]

    def recorded(ps, lr, wd, layers):  # type: ignore[no-untyped-def]
        given.append(wd)
        return sgd(ps, lr, wd, layers)

    monkeypatch.setitem(optimizers.MAKERS, "sgd", recorded)
    monkeypatch.setattr(profiling, "REPEATS", 1)
    per_param = profiling._optimizer_cost(nn.Linear(8, 8), "sgd", torch.device("cpu"), 1e-4)
    assert given == [1e-4] and per_param > 0

"""Elastic training: the run goes on when workers leave or join.

`sampler.py` (the samples of each step, from a committed cursor, whatever the membership),
`batch_policy.py` (the global batch policy: a fixed global batch, or a fixed per-rank batch
with the learning rate rescaled), `horovod_order.py` (Horovod's ElasticSampler partition
over the same cursor), `state.py` (State: commit, restore, sync from a live peer),
`run.py` (`run`: a training function that goes on across membership changes),
`trees.py` (the commit's nested tensors and values). ZeRO's shards in a State are
plait.sharded.ElasticShards (sharded/elastic.py: the strategies sit above this package).
The membership itself changes in plait.comm (membership.py, world.reform); `joined()` says
whether this process joined a running job and has not taken its state yet.

The classes need torch, so they are imported on first use; `batch_policy` is torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from

if TYPE_CHECKING:
    from plait.comm.world import joined
    from plait.elastic.batch_policy import BatchPolicy
    from plait.elastic.run import run
    from plait.elastic.sampler import ElasticSampler, StepPlan
    from plait.elastic.state import State

__all__ = ["BatchPolicy", "ElasticSampler", "State", "StepPlan", "joined", "run"]

__getattr__ = getattr_from(
    __name__,
    {
        "BatchPolicy": "plait.elastic.batch_policy",
        "ElasticSampler": "plait.elastic.sampler",
        "StepPlan": "plait.elastic.sampler",
        "State": "plait.elastic.state",
        "run": "plait.elastic.run",
        "joined": "plait.comm.world",
    },
)

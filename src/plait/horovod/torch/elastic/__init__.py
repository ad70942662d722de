"""hvd.elastic: Horovod 0.28's elastic API for PyTorch, on plait's elastic membership.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                                  # batches; state.commit() every few
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

`run` (loop.py: restore on a failure, re-form the job, reset callbacks, sync, again),
`TorchState`, `ObjectState` and their base `State` (state.py), `ElasticSampler`
(sampler.py). docs/horovod.md's Elastic section says what matches Horovod and what differs.
"""

from plait.horovod.torch.elastic.loop import run
from plait.horovod.torch.elastic.sampler import ElasticSampler
from plait.horovod.torch.elastic.state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]

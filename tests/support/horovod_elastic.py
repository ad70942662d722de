"""A Horovod elastic script in the shape of Horovod's docs example, through plait's facade:
TorchState with the model, optimizer, sampler, epoch and batch; hvd.elastic.ElasticSampler
under a DataLoader; DistributedOptimizer; a commit every few batches; a reset callback that
rescales the learning rate to hvd.size(). Run by tests/world/test_horovod_elastic.py in a
job of 3 processes and a 4th that joins (PLAIT_ELASTIC_JOIN=1), with two planned events:

1. the three hold before their first step (check_host_updates until it raises
   HostsUpdatedInterrupt) until the joiner is admitted: 4 ranks from the first step;
2. the first rank SIGKILLs itself in epoch 0, batch KILL_AT, after its backward (its
   gradients' allreduce started): the 3 others get HorovodInternalError, go back to the
   commit made at the start of batch 3, and finish the run at 3 ranks.

`reference` trains the same steps in one process, those events planned, and `steps` says
which samples each of them trains on.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from plait.elastic.horovod_order import horovod_indices

SAMPLES, BATCH, EPOCHS, SEED = 48, 2, 2, 5  # per-rank batch; no padding at 4 or 3 ranks
BASE_LR, MOMENTUM = 0.05, 0.9
COMMIT_EVERY, KILL_AT = 3, 4  # commits at the start of batches 0 and 3; the kill in 4
# (epoch, samples processed before, ranks, steps): 3 steps at 4 ranks, the 4th lost with
# the 5th (KILL_AT) in flight, 3 * 2 * 4 = 24 samples committed; the rest of epoch 0 at 3
PHASES = [(0, 0, 4, 3), (0, 24, 3, 4), (1, 0, 3, 8)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1).double()


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).squeeze(1) - y) ** 2).mean()


def scenario(_comm: Any) -> dict[str, Any]:
    """One process of the job (the harness ran plait.init(); a joiner's returned once the
    others admitted it)."""
    import plait.horovod.torch as hvd
    from plait.errors import PeerFailureError

    hvd.init()
    first = hvd.rank()  # 0-2: the job's first ranks; 3: the joiner
    x, y = data()
    model = _model(first)  # a model of its own: the first sync makes it rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=MOMENTUM)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), seed=SEED)
    loader = torch.utils.data.DataLoader(list(range(SAMPLES)), batch_size=BATCH, sampler=sampler)
    log: dict[str, Any] = {"errors": [], "resets": 0, "losses": []}

    def on_state_reset() -> None:
        log["resets"] += 1
        for group in opt.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, seen=[])
    state.register_reset_callbacks([on_state_reset])

    def train_epoch(state: Any) -> None:
        offset = state.batch
        for idx, ids in enumerate(loader):
            state.batch = offset + idx
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            opt.zero_grad()
            loss = _loss(model, x[ids], y[ids])
            loss.backward()
            if first == 0 and (state.epoch, state.batch) == (0, KILL_AT):
                os.kill(os.getpid(), signal.SIGKILL)  # the allreduce of its gradients is out
            sampler.record_batch(idx, BATCH)
            try:
                opt.step()
                everyone = hvd.allgather(ids)  # the step's samples, rank by rank
                mean = hvd.allreduce(loss.detach(), name="loss")  # a named op: met by name
            except hvd.HorovodInternalError as e:
                log["errors"].append(
                    {"peer_failure": isinstance(e, PeerFailureError),
                     "rank": getattr(e, "rank", None), "size": hvd.size()}
                )  # fmt: skip
                raise
            state.seen = [*state.seen, [state.epoch, hvd.size(), everyone.tolist()]]
            log["losses"].append(mean.item())

    @hvd.elastic.run
    def train(state: Any) -> None:
        deadline = time.monotonic() + 30
        while hvd.size() == 3 and not state.seen:  # hold: the joiner comes first
            state.check_host_updates()
            if time.monotonic() > deadline:
                raise TimeoutError("the joining process was not admitted within 30 s")
            time.sleep(0.01)
        while state.epoch < EPOCHS:
            train_epoch(state)
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    out = {
        "first": first, "rank": hvd.rank(), "size": hvd.size(), "seen": state.seen,
        "params": [p.detach().tolist() for p in model.parameters()],
        "lr": opt.param_groups[0]["lr"], **log,
    }  # fmt: skip
    hvd.shutdown()
    return out


def steps() -> list[tuple[int, int, list[int]]]:
    """Each planned step: (epoch, ranks, the samples of every rank in rank order), read from
    Horovod's partition (plait.elastic.horovod_order)."""
    out = []
    for epoch, done, size, count in PHASES:
        shares = [
            horovod_indices(SAMPLES, epoch=epoch, processed=done, rank=r, size=size, seed=SEED)
            for r in range(size)
        ]
        for k in range(count):
            ids = [i for share in shares for i in share[k * BATCH : (k + 1) * BATCH]]
            out.append((epoch, size, ids))
    return out


def reference() -> list[Any]:
    """One process, the planned steps: each the mean loss over every rank's samples (the
    ranks' batches are equal, so that is the mean of their means), at lr BASE_LR * ranks."""
    x, y = data()
    model = _model(0)  # the first rank's: what the first sync gives every rank
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=MOMENTUM)
    for _, size, ids in steps():
        for group in opt.param_groups:
            group["lr"] = BASE_LR * size
        _loss(model, x[ids], y[ids]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in model.parameters()]

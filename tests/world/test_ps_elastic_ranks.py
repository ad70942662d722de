"""Parameter-server workers that leave and join a sync job (PSConfig(elastic_workers=True)),
in real processes on loopback (tests/support/ps_world.py).

One world of 3 workers, 1 server and 1 joiner, in float64:
- the joiner (worker id 3) waits until round GO has closed, then joins: the server admits it
  from a round boundary f (f >= GO + 2: the members of the round after the last closed one
  are fixed already), and rounds grow from 3 members to 4 there;
- worker 2, once a round with the joiner in it has closed, pushes its next gradient (the
  server acknowledges it: it is in the round) and SIGKILLs itself. That round still counts
  its gradient (4 members); the next waits for it until the server declares it dead
  (worker_timeout_s = 1 s), then closes over 0, 1 and 3, and so do the rounds after;
- worker 0 ends the run AFTER rounds after the first round without worker 2.
The servers' parameters (every survivor's after its last pull) must equal, to the last bit,
a single-process reference that applies the same rounds: the mean of its members'
gradients. Gradients are rounded to multiples of 2^-20, so each round's sum is exact in
float64 whatever order the pushes came in.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

import plait.ps as ps
from plait.ps.client import Client
from support.ps_world import run_ps_world

pytestmark = pytest.mark.timeout(120)
GO, AFTER = 2, 2  # the joiner joins once round GO has closed; the run ends AFTER rounds after
KEY = "test/ps-elastic/"  # worker 0's signals in the job's store: go, end
LR, MOMENTUM = 0.05, 0.9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).double()


def _gradients(model: torch.nn.Module, worker: int, clock: int) -> list[torch.Tensor]:
    """Worker `worker`'s gradient of round `clock` at the model's values, on 2^-20's grid."""
    g = torch.Generator().manual_seed(1000 * worker + clock)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [torch.round(p.grad * 2**20) / 2**20 for p in model.parameters()]  # type: ignore[operator]


def _job(role: ps.Role) -> dict[str, Any]:
    model = _model()
    cfg = ps.PSConfig(mode="sync", elastic_workers=True, lr=LR, momentum=MOMENTUM,
                      worker_timeout_s=1.0, slice_mb=0.0005)  # fmt: skip
    store = role.store
    if role.joining:
        store.get(KEY + "go")  # round GO has closed
    client = Client(model.named_parameters(), cfg, role)
    first = client.clock + 1  # a joiner's first push
    rounds: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []  # clock, members, next
    end, deadline = None, time.monotonic() + 40
    while end is None or client.clock < end:
        assert time.monotonic() < deadline, rounds[-3:]
        grads = _gradients(model, role.rank, client.clock + 1)
        if role.rank == 2 and any(3 in members for _, members, _ in rounds):
            client.push(grads)  # acknowledged: its gradient is in the round
            os.kill(os.getpid(), signal.SIGKILL)
        client.push_pull(grads)
        assert client.round is not None
        rounds.append((client.round.clock, client.round.members, client.round.next))
        clock, members, _ = rounds[-1]
        if role.rank == 0 and clock == GO:
            store.set(KEY + "go", "1")
        if role.rank == 0 and end is None and 3 in members and 2 not in members:
            end = clock + AFTER  # the others read it before they push round clock + 2
            store.set(KEY + "end", str(end))
        if end is None and store.check([KEY + "end"]):
            end = int(store.get(KEY + "end"))
    dead = client.stats()["dead_workers"]
    client.close()
    params = [p.detach().tolist() for p in model.parameters()]
    return {"first": first, "rounds": rounds, "params": params, "dead": dead}


def _reference(members_of: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One process: round c (from 1) applies SGD with momentum (torch.optim.SGD's update:
    the buffer starts as the first gradient) to the mean of the gradients of
    members_of[c - 1], each taken at the round's values."""
    model, probe = _model(), _model()
    params = list(model.parameters())
    bufs: list[torch.Tensor] = []
    for clock, members in enumerate(members_of, start=1):
        grads = []
        for w in members:
            probe.load_state_dict(model.state_dict())
            grads.append(_gradients(probe, w, clock))
        with torch.no_grad():
            for i, p in enumerate(params):
                mean = torch.stack([g[i] for g in grads]).sum(0) / len(members)
                if len(bufs) <= i:
                    bufs.append(mean.clone())
                else:
                    bufs[i].mul_(MOMENTUM).add_(mean)
                p.add_(bufs[i], alpha=-LR)
    return [p.detach() for p in params]


def test_workers_leave_and_join_a_sync_job() -> None:
    zero, one, _, joiner = run_ps_world(3, 1, _job, tolerate=[2], joiners=1)
    f = joiner["first"]
    end = zero["rounds"][-1][0]
    death = f + 1  # worker 2 pushed once more after the first round with the joiner
    want = [(0, 1, 2)] * (f - 1) + [(0, 1, 2, 3)] * (death - f + 1) + [(0, 1, 3)] * (end - death)
    assert f >= GO + 2 and end == death + 1 + AFTER
    for got in (zero, one):
        assert [c for c, _, _ in got["rounds"]] == list(range(1, end + 1))
        assert [m for _, m, _ in got["rounds"]] == want  # 3 members, then 4, then 3
    assert [c for c, _, _ in joiner["rounds"]] == list(range(f, end + 1))
    assert zero["rounds"][f - 2][2] == (0, 1, 2, 3)  # round f's members, told with f - 1's
    assert zero["dead"] == [2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' own: the same kernels for the gradients
    try:
        ref = _reference(want)
    finally:
        torch.set_num_threads(threads)
    for got in (zero, one, joiner):
        for a, b in zip(got["params"], ref, strict=True):
            assert torch.equal(torch.tensor(a, dtype=torch.float64), b)

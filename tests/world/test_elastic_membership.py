"""An elastic job's membership changes without restarting processes (issue 33): a rank
killed in the middle of an allreduce, the survivors re-form and go on with the right sums;
a rank frozen with SIGSTOP is left out, and fenced when SIGCONT wakes it; a process joins
the running job at a commit and takes its state from a live rank. (Training through
plait.elastic.run under a launcher that hosts the store: `plait train --elastic`,
tests/e2e/test_elastic_command.py.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from plait.comm import world
from plait.errors import FencedError, PeerFailureError
from support.world import worlds_at_once

pytestmark = pytest.mark.timeout(120)
ENV = {"PLAIT_HEARTBEAT_TIMEOUT": "2"}


def _killed(comm: Any) -> dict[str, Any]:
    """Rank 1 of 3 dies (SIGKILL) in its third allreduce; the others re-form and go on."""
    sums, failures = [], []
    step = 0
    while step < 6:
        if comm.rank == 1 and comm.size == 3 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            sums.append((comm.size, comm.allreduce(torch.tensor([float(comm.rank + 1)])).item()))
            step += 1
        except PeerFailureError as e:
            failures.append(e.rank)
            comm = world.reform()  # the in-flight step is redone by the survivors
    return {"sums": sums, "failures": failures, "rank": comm.rank, "size": comm.size,
            "label": comm.label}  # fmt: skip


def _frozen(comm: Any, said: str) -> Any:
    """Rank 2 of 3 is frozen (SIGSTOP by rank 0) at step 2; the others leave it out, and
    rank 0 wakes it (SIGCONT) once they went on: it finds itself fenced, and writes what it
    was told to `said` (a tolerated rank's result does not come back)."""
    pids = comm.allgather_object(os.getpid())
    sums = []
    step = 0
    woken = False
    while step < 6:
        if comm.rank == 0 and comm.size == 3 and step == 2:
            os.kill(pids[2], signal.SIGSTOP)
        try:
            sums.append(comm.allreduce(torch.tensor([float(comm.rank + 1)])).item())
            step += 1
        except PeerFailureError:
            try:
                comm = world.reform()
            except FencedError as e:
                with open(said, "w") as f:
                    f.write(str(e))
                return None
        if comm.size == 2 and comm.rank == 0 and step == 4 and not woken:
            os.kill(pids[2], signal.SIGCONT)
            woken = True
    deadline = time.monotonic() + 15
    while comm.rank == 0 and not os.path.exists(said) and time.monotonic() < deadline:
        time.sleep(0.05)  # the woken rank's attempt, while the others still live
    return {"sums": sums, "size": comm.size}


def _joined(comm: Any) -> dict[str, Any]:
    """Three ranks train under plait.elastic.run; a fourth process joins the running job.
    The three hold at step 3 (committing, which asks for joiners) until it is admitted, so
    the change falls at a known step; the joiner takes the state from rank 0 and every rank
    ends with the same total: 3 workers' sums for 3 steps, then 4 workers' for 3."""
    import plait
    from plait.elastic import State

    state = State(total=torch.zeros(1, dtype=torch.float64), step=0, sizes=[])

    @plait.elastic.run
    def train(state: Any) -> None:
        comm = plait.default()
        while state.step < 6:
            if comm.size == 3 and state.step == 3:
                time.sleep(0.02)
                state.commit()  # raises JoinRequested once the joiner registered
                continue
            state.total += comm.allreduce(torch.ones(1, dtype=torch.float64))
            state.sizes = [*state.sizes, comm.size]
            state.step += 1
            state.commit(check=state.step > 3)  # not before: the change falls at step 3

    joiner = plait.elastic.joined()
    train(state)
    comm = plait.default()
    return {"total": state.total.item(), "sizes": state.sizes, "changes": state.changes,
            "rank": comm.rank, "size": comm.size, "joiner": joiner,
            "joined_after": plait.elastic.joined()}  # fmt: skip


ZERO_STEPS, ZERO_BATCH = 6, 12


def _zero_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 3, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _zero_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    ).double()


def _zero_step(model: Any, opt: Any, x: Any, y: Any) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _zero(comm: Any) -> dict[str, Any]:
    """ZeRO stage 3 with Adam in float64 over 3 ranks: rank 1 dies (SIGKILL) in step 2; its
    shards live on in rank 2's replica and are re-laid over the 2 survivors, who redo step 2;
    a fourth process joins (with that change, or at step 4, whichever it reaches first) and
    is given its shards of the 3-way layout. The global batch is fixed: 12 samples, in equal
    parts at 3 ranks and at 2."""
    import plait
    from plait.elastic import State
    from plait.sharded import ElasticShards

    x, y = _zero_data()
    zero = ElasticShards(_zero_model(), lambda params: torch.optim.Adam(params, lr=0.05),
                         stage=3, units=["0", "2"])  # fmt: skip
    state = State(zero=zero, step=0)

    @plait.elastic.run
    def train(state: Any) -> None:
        comm = plait.default()
        while state.step < ZERO_STEPS:
            if comm.size == 2 and state.step == 4:
                time.sleep(0.02)
                state.commit()  # until the joiner is in
                continue
            ids = torch.arange(state.step * ZERO_BATCH, (state.step + 1) * ZERO_BATCH) % 48
            mine = torch.tensor_split(ids, comm.size)[comm.rank]
            if comm.size == 3 and comm.rank == 1 and state.step == 2 and not state.changes:
                os.kill(os.getpid(), signal.SIGKILL)  # the others are inside the step
            assert zero.module is not None
            _zero_step(zero.module, zero.optimizer, x[mine], y[mine])
            state.step += 1
            state.commit(check=state.step >= 4)  # or the joiner may come before the kill

    train(state)
    assert zero.module is not None
    return {"params": {k: v.tolist() for k, v in zero.module.state_dict().items()},
            "changes": state.changes, "size": plait.default().size}  # fmt: skip


def _zero_reference() -> dict[str, Any]:
    """One process, the whole global batch each step (the mean over 12 samples is the mean
    of the ranks' means: their parts are equal at 4 ranks and at 3)."""
    x, y = _zero_data()
    model = _zero_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(ZERO_STEPS):
        ids = torch.arange(step * ZERO_BATCH, (step + 1) * ZERO_BATCH) % 48
        _zero_step(model, opt, x[ids], y[ids])
    return {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    common = {"env": ENV, "timeout": 60}
    said = str(tmp_path_factory.mktemp("fenced") / "said.txt")
    with worlds_at_once(
        {
            "killed": (3, _killed, (), {**common, "tolerate": [1]}),
            "frozen": (3, _frozen, (said,), {**common, "tolerate": [2]}),
            "joined": (4, _joined, (), {**common, "joiners": 1}),
            "zero": (4, _zero, (), {**common, "tolerate": [1], "joiners": 1}),
        }
    ) as futures:
        yield {**futures, "said": said}


def test_survivors_of_a_killed_rank_reform_and_go_on(worlds: dict[str, Any]) -> None:
    results = worlds["killed"].result()
    for old in (0, 2):
        r = results[old]
        assert r["failures"] == [1], r
        # 3 ranks: 1+2+3; then 2 ranks (old 0 and 2 as new 0 and 1): 1+2, every step once
        assert r["sums"] == [(3, 6.0), (3, 6.0)] + [(2, 3.0)] * 4, r
        assert (r["rank"], r["size"], r["label"]) == ({0: 0, 2: 1}[old], 2, "world")


def test_a_frozen_rank_is_left_out_and_fenced_when_it_wakes(worlds: dict[str, Any]) -> None:
    results = worlds["frozen"].result()
    for old in (0, 1):
        assert results[old] == {"sums": [6.0, 6.0, 3.0, 3.0, 3.0, 3.0], "size": 2}, results
    with open(worlds["said"]) as f:
        said = f.read()
    assert "rank 2 is not in generation 1" in said and "must exit" in said, said


def test_a_process_joins_the_running_job_at_a_commit(worlds: dict[str, Any]) -> None:
    results = worlds["joined"].result()
    change = {"generation": 1, "left": [], "joined": 1, "size": 4}
    for r, got in enumerate(results):
        assert (got["rank"], got["size"], got["joined_after"]) == (r, 4, False), got
        # the joiner's state is rank 0's: the steps before it came, as the others hold them
        assert got["sizes"] == [3, 3, 3, 4, 4, 4] and got["total"] == 21.0, got
        assert got["joiner"] == (r == 3), got
        assert got["changes"] == [change], got  # the joiner's too: its admission


def test_zero_shards_are_re_laid_from_the_ring_replica(worlds: dict[str, Any]) -> None:
    results = worlds["zero"].result()
    want = _zero_reference()
    left = {"generation": 1, "left": [1], "size": 2}
    for old in (0, 2, 3):
        got = results[old]
        assert got["size"] == 3, got
        if old != 3:  # the joiner came with the failure's change, or at step 4
            assert got["changes"] in (
                [{**left, "joined": 1, "size": 3}],
                [{**left, "joined": 0}, {"generation": 2, "left": [], "joined": 1, "size": 3}],
            ), got["changes"]
        for name, value in want.items():
            # float64; the ranks' mean of means against one mean: 1e-12, not bits
            torch.testing.assert_close(
                torch.tensor(got["params"][name]), torch.tensor(value), rtol=1e-12, atol=1e-14
            )

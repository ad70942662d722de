"""The shared-memory transport: answers, bit-identity, no messages, no leftovers, failures.

Every world here has all its ranks on one host, so `algorithm="auto"` is "shm" too. The
slot size is shrunk inside the ranks so that tensors larger than a slot (sent in parts)
are covered with small tensors. The rules without a world are in tests/unit/test_shm_sizes.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from plait import Communicator
from plait.comm.transport import arena
from plait.comm.transport.shared_memory import SHM_DIR
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
SIZES = (0, 1, 5, 1000, 20_001)  # 20_001 x 8 bytes > the 64 KiB test slot: in parts
SMALL_SLOT = 1 << 16


def _leftovers() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("plait-")}


def _inputs(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    x = torch.randn(n, generator=g) * 3
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


def _battery(comm: Communicator) -> Any:
    arena.MAX_SLOT = SMALL_SLOT
    out: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        for n in SIZES:
            x = _inputs(comm.rank, dtype, n)
            for op in ("sum", "avg", "max", "min"):
                out[f"{dtype}-{n}-{op}"] = comm.allreduce(x, op=op, algorithm="shm")
    wide = _inputs(comm.rank, torch.float32, 2 * 301).view(301, 2)
    out["strided"] = comm.allreduce(wide[:, 1], algorithm="shm")  # not contiguous
    for root in range(comm.size):
        out[f"bcast-{root}"] = comm.broadcast(_inputs(comm.rank, torch.float64, 20_001), root,
                                              algorithm="shm")  # fmt: skip
    # after the segment exists, an allreduce sends no message at all
    x = _inputs(comm.rank, torch.float32, 1000)
    before = comm.engine.counts()
    comm.allreduce(x, algorithm="shm", check=False)
    comm.allreduce(x, algorithm="auto", check=False)
    messages = sum(s + r for s, r in comm.engine.counts().values()) - sum(
        s + r for s, r in before.values()
    )
    # plain lists: a tensor put on a multiprocessing queue travels as a shared-memory handle
    # that dies with the rank's process; float64 holds every value here exactly
    return {k: (str(v.dtype), v.double().tolist()) for k, v in out.items()}, messages, _leftovers()


def _reference(size: int, key: str) -> torch.Tensor:
    if key.startswith("bcast-"):
        return _inputs(int(key.split("-")[1]), torch.float64, 20_001)
    if key == "strided":
        return sum(_inputs(r, torch.float32, 602).view(301, 2)[:, 1] for r in range(size))
    name, n, op = key.rsplit("-", 2)
    dtype = next(d for d in DTYPES if str(d) == name)
    xs = torch.stack([_inputs(r, dtype, int(n)).double() for r in range(size)])
    if op == "max":
        return xs.max(0).values.to(dtype)
    if op == "min":
        return xs.min(0).values.to(dtype)
    total = xs.sum(0)
    if op == "avg":
        total = total / size if dtype.is_floating_point else torch.trunc(total / size)
    return total.to(dtype)


def _world(comm: Communicator) -> dict[str, Any]:
    """The battery; then at 2 and 3 ranks the gathers, at 4 the wait for a slow peer (one
    world per size: a world costs seconds)."""
    out = {"battery": _battery(comm)}
    if comm.size in (2, 3):
        out["gathers"] = _gathers(comm)
    if comm.size == 4:
        out["cpu_while_waiting"] = _cpu_while_waiting(comm)
    return out


Ranks = list[dict[str, Any]]  # each rank's results


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request: pytest.FixtureRequest) -> tuple[set[str], Ranks]:
    """The segments in /dev/shm before, and the world of `request.param` ranks."""
    before = _leftovers()
    return before, run_world(request.param, _world, timeout=150, env=ENV)


@pytest.mark.timeout(180)
def test_shared_memory_collectives_are_right_and_identical_on_every_rank(
    world: tuple[set[str], Ranks],
) -> None:
    before, results = world
    size = len(results)
    ranks = [r["battery"] for r in results]
    first = ranks[0][0]
    for key, (dtype, got) in first.items():
        want = _reference(size, key)
        assert dtype == str(want.dtype), key
        low = want.dtype in (torch.float16, torch.bfloat16)
        tol = {"rtol": 2e-2, "atol": 5e-2} if low else {}
        torch.testing.assert_close(torch.tensor(got).to(want.dtype), want, **tol, msg=key)
        for out, _, _ in ranks[1:]:
            assert out[key][1] == got, f"{key}: ranks differ"  # bit-identical
    for _, messages, names in ranks:
        assert messages == 0  # no byte went through the sockets
        assert not names - before  # the segment's name was unlinked once mapped
    assert not _leftovers() - before


def _grow(comm: Communicator) -> Any:
    sizes = []
    for n in (10, 1 << 19, 3 << 20):  # 40 B, 2 MiB, 12 MiB: the slots grow twice
        x = torch.full((n,), float(comm.rank + 1))
        assert comm.allreduce(x, algorithm="shm")[n - 1].item() == comm.size * (comm.size + 1) / 2
        assert "all" in comm.arenas
        sizes.append(comm.arenas["all"].slot_bytes)
    return sizes


@pytest.mark.timeout(90)
def test_the_segment_grows_for_larger_tensors() -> None:
    for sizes in run_world(2, _grow, timeout=60, env=ENV):
        assert sizes == [arena.MIN_SLOT, 2 << 20, 16 << 20]


def _cpu_while_waiting(comm: Communicator) -> Any:
    x = torch.ones(1000)
    comm.allreduce(x, algorithm="shm")  # the segment exists; everyone is in step
    if comm.rank == 1:
        import time

        time.sleep(1.0)  # a slow peer: the others wait for it inside the collective
    cpu = os.times()
    comm.allreduce(x, algorithm="shm", check=False)
    after = os.times()
    return (after.user - cpu.user) + (after.system - cpu.system), after.elapsed - cpu.elapsed


@pytest.mark.parametrize("world", [4], indirect=True)
def test_waiting_for_a_slow_peer_does_not_burn_a_core(world: tuple[set[str], Ranks]) -> None:
    # 4 ranks on this 2-core machine: a waiting rank must leave the cores to the others
    for rank, (cpu, wall) in enumerate(r["cpu_while_waiting"] for r in world[1]):
        print(f"rank {rank}: {cpu:.3f} s CPU in {wall:.2f} s inside the allreduce")
        if rank != 1:
            assert wall > 0.8, (rank, wall)  # it did wait for rank 1
            assert cpu < 0.25 * wall, f"rank {rank} used {cpu:.2f} s of CPU in {wall:.2f} s"


def _gathers(comm: Communicator) -> Any:
    arena.MAX_SLOT = SMALL_SLOT  # 64 KiB slots: the 30_000-row tensors go in windows
    out = []
    for rows in (1, 7, 30_000):
        x = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3) + comm.rank
        for op in ("sum", "max", "avg"):
            got = {a: comm.reduce_scatter(x, op=op, algorithm=a) for a in ("shm", "auto", "ring")}
            out.append(all(torch.equal(got[a], got["ring"]) for a in ("shm", "auto")))
        mine = torch.full((comm.rank + rows % 5, 2), float(comm.rank))  # uneven dim 0
        got = {a: comm.allgather(mine, algorithm=a) for a in ("shm", "auto", "ring")}
        out.append(all(torch.equal(got[a], got["ring"]) for a in ("shm", "auto")))
    return out


@pytest.mark.parametrize("world", [2, 3], indirect=True)
def test_reduce_scatter_and_allgather_through_shared_memory_equal_the_ring(
    world: tuple[set[str], Ranks],
) -> None:
    for checks in (r["gathers"] for r in world[1]):
        assert checks and all(checks)

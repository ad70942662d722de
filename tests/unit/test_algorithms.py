"""plait's collective algorithms against a single-process torch reference, on a fake world.

Inputs are small integers (-2..2) so that every reduction order gives exact results in
every dtype (sums stay far below 2^8, products are 0 or +-2^k): the reference comparison
is then exact equality. Random floats, where the order does matter, check that all ranks
end bit-identical.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from plait.comm.algorithms import direct, halving_doubling, ring, tree
from plait.comm.core.channel import Channel
from support.fake_channel import FakeChannel, FakeWorld, run_threads

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "prod", "min", "max"]
WORLDS = [1, 2, 3, 4, 5]

Allreduce = Callable[[Channel, torch.Tensor, str], None]
ALLREDUCES: dict[str, Allreduce] = {
    "ring": ring.allreduce,
    # 1000 elements: 2..7 segments per block, depending on the dtype and the world size
    "ring_segmented": lambda ch, b, op: ring.allreduce(ch, b, op, segment_bytes=256),
    "halving_doubling": halving_doubling.allreduce,
    "tree": tree.allreduce,
}


def small_ints(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (n,), generator=g).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    x = torch.stack(inputs)
    if op == "sum":
        return x.sum(0, dtype=x.dtype)
    if op == "prod":
        return x.prod(0, dtype=x.dtype)
    return x.amin(0) if op == "min" else x.amax(0)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rank_inputs(p: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    return [small_ints(n, dtype, 1000 * seed + 10 * n + r) for r in range(p)]


def run_cases(p: int, cases: list[Any], body: Callable[..., torch.Tensor]) -> list[list[Any]]:
    """Run body(ch, *case) for every case inside one world; results[rank][case]."""

    def fn(ch: FakeChannel) -> list[Any]:
        return [body(ch, *case) for case in cases]

    return run_threads(p, fn)


# ---------------------------------------------------------------- equivalence: allreduce


@pytest.mark.parametrize("p", [*WORLDS, 6])
@pytest.mark.parametrize("name", list(ALLREDUCES))
def test_allreduce_matches_reference(name: str, p: int) -> None:
    algo = ALLREDUCES[name]
    cases = [
        (op, rank_inputs(p, n, dtype))
        for dtype in DTYPES
        for op in OPS
        for n in sorted({0, 1, max(p - 1, 0), 7, 1000})
    ]
    g = torch.Generator().manual_seed(p)  # random floats: order matters, ranks must agree
    floats = [
        (op, [torch.randn(999, generator=g, dtype=d) + 0.5 for _ in range(p)])
        for d in (torch.float32, torch.float64)
        for op in ("sum", "prod")
    ]

    def body(ch: FakeChannel, op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
        buf = inputs[ch.rank].clone()
        algo(ch, buf, op)
        return buf

    out = run_cases(p, cases + floats, body)
    for i, (op, inputs) in enumerate(cases + floats):
        want = reference([x.double() for x in inputs], op).to(inputs[0].dtype)
        if i < len(cases):
            assert torch.equal(out[0][i], want), (op, want.dtype, want.numel())
        torch.testing.assert_close(out[0][i], want, rtol=1e-4, atol=1e-5)
        assert all(same_bytes(out[r][i], out[0][i]) for r in range(p))


# ------------------------------------------------- equivalence: ring reduce-scatter/allgather


def uneven_bounds(p: int, scale: int) -> list[list[int]]:
    """A few block layouts for p ranks: uneven with empty blocks, all empty, one big block."""
    layouts = [[(5 * r + 2) % 4 * scale for r in range(p)], [0] * p, [0] * (p - 1) + [scale]]
    return [[0, *torch.tensor(s, dtype=torch.long).cumsum(0).tolist()] for s in layouts]


@pytest.mark.parametrize("p", WORLDS)
def test_ring_reduce_scatter_and_allgather_uneven(p: int) -> None:
    cases = [
        (dtype, op, bounds, seg)
        for dtype in DTYPES
        for op in OPS
        for scale, seg in ((1, 1 << 20), (9, 16))
        for bounds in uneven_bounds(p, scale)
    ]
    data = {i: rank_inputs(p, c[2][-1], c[0], seed=i) for i, c in enumerate(cases)}

    def body(ch: FakeChannel, i: int, op: str, bounds: list[int], seg: int) -> Any:
        r = ch.rank
        rs = data[i][r].clone()
        ring.reduce_scatter(ch, rs, op, bounds, segment_bytes=seg)
        ag = torch.full_like(data[i][r], 99)  # garbage outside this rank's block
        ag[bounds[r] : bounds[r + 1]] = data[i][0][bounds[r] : bounds[r + 1]]
        if op == "sum":  # all-gather has no op: once per layout is enough
            ring.allgather(ch, ag, bounds, segment_bytes=seg)
        return rs[bounds[r] : bounds[r + 1]], ag

    out = run_cases(p, [(i, c[1], c[2], c[3]) for i, c in enumerate(cases)], body)
    for i, (_, op, bounds, _) in enumerate(cases):
        want = reference(data[i], op)
        for r in range(p):
            rs, ag = out[r][i]
            assert torch.equal(rs, want[bounds[r] : bounds[r + 1]]), (op, bounds, r)
            assert op != "sum" or torch.equal(ag, data[i][0]), (bounds, r)


def test_bounds_even_matches_tensor_split_and_bad_bounds_raise() -> None:
    for numel in (0, 1, 5, 17):
        for parts in (1, 3, 4, 8):
            sizes = [t.numel() for t in torch.arange(numel).tensor_split(parts)]
            b = ring.bounds_even(numel, parts)
            assert [b[i + 1] - b[i] for i in range(parts)] == sizes
    ch = FakeChannel(FakeWorld(2), 0)
    with pytest.raises(ValueError, match="len"):
        ring.reduce_scatter(ch, torch.zeros(4), "sum", [0, 4])
    with pytest.raises(ValueError, match="non-decreasing"):
        ring.allgather(ch, torch.zeros(4), [0, 5, 4])


# ------------------------------------------------------------- equivalence: tree and direct


@pytest.mark.parametrize("p", [*WORLDS, 8])
def test_tree_reduce_and_broadcast_every_root(p: int) -> None:
    cases = [
        (dtype, op, n, root)
        for dtype in (torch.float32, torch.bfloat16, torch.int64)
        for op in OPS
        for n in (0, 1, 7)
        for root in range(p)
    ]
    data = {i: rank_inputs(p, c[2], c[0], seed=i) for i, c in enumerate(cases)}

    def body(ch: FakeChannel, i: int, op: str, root: int) -> Any:
        red = data[i][ch.rank].clone()
        tree.reduce(ch, red, op, root)
        bc = data[i][ch.rank].clone()
        tree.broadcast(ch, bc, root)
        return red, bc

    out = run_cases(p, [(i, c[1], c[3]) for i, c in enumerate(cases)], body)
    for i, (_, op, _, root) in enumerate(cases):
        assert torch.equal(out[root][i][0], reference(data[i], op))
        for r in range(p):
            assert same_bytes(out[r][i][1], data[i][root])


@pytest.mark.parametrize("p", WORLDS)
def test_gather_scatter_alltoall_allgather_small(p: int) -> None:
    sizes = [(3 * r + 1) % 4 for r in range(p)]  # 1, 0, 3, 2, 1: uneven, some empty
    a2a = [[(2 * i + j) % 3 for j in range(p)] for i in range(p)]  # a2a[i][j]: i -> j

    def block(src: int, dst: int, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64) + 100 * src + 10 * dst

    def empties(ns: list[int]) -> list[torch.Tensor]:
        return [torch.full((n,), -1, dtype=torch.int64) for n in ns]

    def fn(ch: FakeChannel) -> None:  # asserts inside a thread fail the run
        r = ch.rank
        for root in range(p):
            recv = empties(sizes)
            direct.gather(ch, block(r, root, sizes[r]), recv if r == root else None, root)
            if r == root:
                assert all(torch.equal(recv[j], block(j, root, sizes[j])) for j in range(p))
            mine = empties([sizes[r]])[0]
            send = [block(root, j, sizes[j]) for j in range(p)] if r == root else None
            direct.scatter(ch, send, mine, root)
            assert torch.equal(mine, block(root, r, sizes[r]))
        recv = empties([a2a[j][r] for j in range(p)])
        direct.alltoall(ch, [block(r, j, a2a[r][j]) for j in range(p)], recv)
        assert all(torch.equal(recv[j], block(j, r, a2a[j][r])) for j in range(p))
        recv = empties(sizes)
        direct.allgather_small(ch, block(r, 0, sizes[r]), recv)
        assert all(torch.equal(recv[j], block(j, 0, sizes[j])) for j in range(p))

    run_threads(p, fn)


@pytest.mark.parametrize("p", WORLDS)
def test_barrier_holds_everyone(p: int) -> None:
    arrived, lock = [0], threading.Lock()

    def fn(ch: FakeChannel) -> int:
        time.sleep(0.002 * ((ch.rank * 7) % p))  # arrive in a scrambled order
        with lock:
            arrived[0] += 1
        direct.barrier(ch)
        return arrived[0]

    assert run_threads(p, fn) == [p] * p


# -------------------------------------------------------------------------------- structure


def record(p: int, fn: Callable[..., None], *args: Any) -> FakeWorld:
    world = FakeWorld(p)
    world.run(fn, *args)
    return world


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("segments", [1, 3])
def test_ring_structure(p: int, segments: int) -> None:
    numel = p * 4 * segments  # 4 float32 per segment: 16 bytes
    world = record(p, lambda ch: ring.allreduce(ch, torch.ones(numel), "sum", segment_bytes=16))
    for m in world.messages:
        assert m.dst == (m.src + 1) % p, "ring messages only go to the right neighbour"
        assert m.nbytes == 16
    for r in range(p):
        assert len(world.sent_by(r)) == 2 * (p - 1) * segments
    if segments == 1:
        assert world.rounds() == 2 * (p - 1)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_halving_doubling_structure(p: int) -> None:
    p2 = 1 << (p.bit_length() - 1)
    rem, steps, n = p - p2, p2.bit_length() - 1, 16 * p
    world = record(p, lambda ch: halving_doubling.allreduce(ch, torch.ones(n), "sum"))
    masks = [1 << k for k in range(steps)]
    masks += masks[::-1]  # halving at distance 1, 2, 4...; doubling back 4, 2, 1
    halves = [n >> (k + 1) for k in range(steps)]  # elements sent at each halving step
    for r in range(p):
        sent, got = world.sent_by(r), world.received_by(r)
        if r < 2 * rem and r % 2 == 0:  # folded away: whole vector out, result back
            assert [(m.dst, m.numel) for m in sent] == [(r + 1, n)]
            assert [(m.src, m.numel) for m in got] == [(r + 1, n)]
            continue
        if r < 2 * rem:  # absorbs its even partner first, returns the result last
            assert [(m.numel, m.depth) for m in got if m.src == r - 1] == [(n, 1)]
            assert (sent[-1].dst, sent[-1].numel) == (r - 1, n)
            sent = sent[:-1]
        v = r // 2 if r < 2 * rem else r - rem
        partners = [v ^ mask for mask in masks]  # virtual ranks, mapped back to ranks
        assert [m.dst for m in sent] == [2 * u + 1 if u < rem else u + rem for u in partners]
        assert [m.numel for m in sent] == halves + halves[::-1]
    assert world.rounds() == 2 * steps + (2 if rem else 0)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_tree_and_barrier_rounds(p: int) -> None:
    lg = math.ceil(math.log2(p))

    def bcast(ch: FakeChannel, root: int) -> None:
        tree.broadcast(ch, torch.ones(3), root)

    def reduce(ch: FakeChannel, root: int) -> None:
        tree.reduce(ch, torch.ones(3), "sum", root)

    for root in (0, p - 1):
        world = record(p, bcast, root)
        assert world.rounds() == lg
        assert len(world.sent_by(root)) == lg
        assert len(world.messages) == p - 1
        world = record(p, reduce, root)
        assert world.rounds() <= lg  # the root's lg p receives come one per round
        assert len(world.messages) == p - 1
        assert len(world.received_by(root)) == lg
    world = record(p, direct.barrier)
    assert world.rounds() == lg
    for r in range(p):
        assert [m.dst for m in world.sent_by(r)] == [(r + (1 << k)) % p for k in range(lg)]
        assert all(m.nbytes == 0 for m in world.sent_by(r))


@pytest.mark.parametrize("p", [2, 3, 5])
def test_alltoall_sends_p_minus_1(p: int) -> None:
    def fn(ch: FakeChannel) -> None:
        direct.alltoall(ch, [torch.ones(2) for _ in range(p)], [torch.empty(2) for _ in range(p)])

    world = record(p, fn)
    for r in range(p):
        assert [m.dst for m in world.sent_by(r)] == [(r + k) % p for k in range(1, p)]
    assert world.rounds() == p - 1  # one message at a time per rank


# ----------------------------------------------------------------------------- the fake


def wrong_size(ch: FakeChannel) -> None:
    (ch.isend(torch.ones(3), 1) if ch.rank == 0 else ch.irecv(torch.empty(2), 0)).wait()


def deadlock(ch: FakeChannel) -> None:
    ch.irecv(torch.empty(1), 1 - ch.rank).wait()


def send_buffer_reuse(ch: FakeChannel) -> None:
    buf = torch.ones(2)
    req = ch.isend(buf, 1) if ch.rank == 0 else ch.irecv(buf, 0)
    buf.add_(ch.rank == 0)  # rank 0 changes what it is still sending
    req.wait()


@pytest.mark.parametrize(
    "program, error",
    [(wrong_size, "receive from rank 0"), (deadlock, "deadlock"), (send_buffer_reuse, "changed")],
)
def test_fake_world_catches_bugs(program: Callable[[FakeChannel], None], error: str) -> None:
    with pytest.raises(RuntimeError, match=error):
        FakeWorld(2, timeout=0.2).run(program)


def test_fake_world_matches_in_post_order() -> None:
    def fifo(ch: FakeChannel) -> Any:
        a, b = torch.tensor([1.0]), torch.tensor([2.0])
        reqs = (
            [ch.isend(a, 1), ch.isend(b, 1)] if ch.rank == 0 else [ch.irecv(a, 0), ch.irecv(b, 0)]
        )
        reqs[1].wait()
        reqs[0].wait()
        return a.item(), b.item()

    assert run_threads(2, fifo)[1] == (1.0, 2.0)

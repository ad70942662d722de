"""The Communicator's exchanges checked on one rank of a world: gathers, scatter and alltoall,
point-to-point and objects, the barrier, who talks to whom, and split communicators."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from plait import Communicator
from support.comm_checks import GATHER, OPS, Checks, every, f32, i64, ints, reduced
from support.comm_reductions import check_allreduce, check_broadcast_reduce


def check_gathers(comm: Communicator, ck: Checks, dtypes: list[torch.dtype]) -> None:
    p, r = comm.size, comm.rank
    row_counts: list[Callable[[int], int]] = [lambda q: q + 1, lambda q: q % 2, lambda q: 2]
    for algo in GATHER:
        for dtype in dtypes:
            for i, rows in enumerate(row_counts):  # dim 0 differs across ranks, or not
                xs = [ints((rows(q), 3), dtype, ck.next(), q) for q in range(p)]
                got = comm.allgather(xs[r], algorithm=algo)
                ck.equal(f"allgather {algo} {dtype} rows#{i}", got, torch.cat(xs))
        xs = [b.t() for b in every(p, (3, 2), f32, ck.next())]  # non-contiguous
        ck.equal(f"allgather {algo} transposed", comm.allgather(xs[r], algo), torch.cat(xs))
        for shape in [(0, 2, 2), (2, 0)]:  # no rows; rows of nothing
            xs = every(p, shape, i64, ck.next())
            got = comm.allgather(xs[r], algo)
            ck.equal(f"allgather {algo} empty {shape}", got, torch.cat(xs))
            got = comm.reduce_scatter(torch.cat(xs), algorithm=algo)
            want = torch.cat(xs).mul(p).tensor_split(p)[r]
            ck.equal(f"reduce_scatter {algo} empty {shape}", got, want, share=False)
        # reduce-scatter: even rows, uneven, fewer rows than ranks, none
        combos = [(dtype, OPS[i % len(OPS)]) for i, dtype in enumerate(dtypes)]
        combos += [(dtypes[-1], op) for op in OPS]
        for dtype, op in combos:
            for rows in (2 * p, p + 1, 1, 0):
                xs = every(p, (rows, 2), dtype, ck.next())
                got = comm.reduce_scatter(xs[r], op=op, algorithm=algo)
                want = reduced(xs, op).tensor_split(p)[r]
                ck.equal(f"reduce_scatter {algo} {dtype} {op} rows {rows}", got, want, False)
        xs = every(p, (2, 2 * p), f32, ck.next())
        got = comm.reduce_scatter(xs[r].t(), algorithm=algo)
        want = reduced([x.t() for x in xs], "sum").tensor_split(p)[r]
        ck.equal(f"reduce_scatter {algo} transposed", got, want, share=False)

    for dtype in dtypes:
        xs = every(p, (2 * p + 1, 2), dtype, ck.next())  # split as torch.tensor_split
        want = torch.cat([x.tensor_split(p)[r] for x in xs])
        ck.equal(f"alltoall {dtype}", comm.alltoall(xs[r]), want, share=False)

        def splits(q: int) -> list[int]:  # different on every rank, some empty
            return [(q + j) % 3 for j in range(p)]

        xs = [ints((sum(splits(q)), 3), dtype, ck.next(), q) for q in range(p)]
        want = torch.cat([x.split(splits(q))[r] for q, x in enumerate(xs)])
        ck.equal(f"alltoall {dtype} splits", comm.alltoall(xs[r], splits(r)), want, False)
    xs = [b.t() for b in every(p, (2, p + 2), f32, ck.next())]
    want = torch.cat([x.tensor_split(p)[r] for x in xs])
    ck.equal("alltoall transposed", comm.alltoall(xs[r]), want, share=False)
    xs = every(p, (0, 4), f32, ck.next())
    ck.equal("alltoall empty", comm.alltoall(xs[r], [0] * p), torch.empty(0, 4), False)

    for root in range(p):
        for dtype in dtypes if root == p - 1 else dtypes[:1]:
            xs = [ints((q % 3, 2), dtype, ck.next(), q) for q in range(p)]
            got = comm.gather(xs[r], root=root)
            if r == root:
                ck.equal(f"gather root {root} {dtype}", got, torch.cat(xs), share=False)
            else:
                ck.true(f"gather root {root}: None off the root", got is None, got)
            for rows in (2 * p + 1, 1):
                big = ints((rows, 3), dtype, ck.next(), root)
                mine = big.clone() if r == root else (None if r % 2 else torch.zeros(rows, 3))
                got = comm.scatter(mine, root=root)
                want = big.tensor_split(p)[r]
                ck.equal(f"scatter root {root} {dtype} rows {rows}", got, want, share=False)
    xs = [b.t() for b in every(p, (2, 3), f32, ck.next())]
    got = comm.gather(xs[r], root=0)
    if r == 0:
        ck.equal("gather transposed", got, torch.cat(xs), share=False)
    big = ints((3, 2 * p), f32, ck.next(), 0)
    got = comm.scatter(big.t() if r == 0 else None)
    ck.equal("scatter transposed", got, big.t().tensor_split(p)[r], share=False)


def check_p2p_and_objects(comm: Communicator, ck: Checks) -> None:
    p, r = comm.size, comm.rank
    objs = [{"rank": q, "items": list(range(q)), "text": "é" * q} for q in range(p)]
    for root in range(p):
        got = comm.broadcast_object(objs[r] if r == root else None, root=root)
        ck.true(f"broadcast_object root {root}", got == objs[root], got)
    got = comm.allgather_object(objs[r])
    ck.true("allgather_object", got == objs, got)
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    # two tags to the right; received from the left in the other order
    msgs = {
        tag: [ints((n,), dtype, ck.next(), q) for q in range(p)]
        for tag, n, dtype in ((1, 5, f32), (2, 300_000, torch.bfloat16))
    }
    sends = [comm.isend(msgs[tag][r], right, tag=tag) for tag in (1, 2)]
    for tag in (2, 1):
        got = comm.recv(torch.empty_like(msgs[tag][left]), left, tag=tag)
        ck.equal(f"recv tag {tag}", got, msgs[tag][left], share=False)
    for s in sends:
        s.wait()
    # blocking send and recv, in both orders; a large message (straight into the buffer)
    xs = every(p, (600_000,), i64, ck.next())
    if r % 2 == 0:
        comm.send(xs[r], right, tag=5)
        got = comm.recv(torch.empty(600_000, dtype=i64), left, tag=5)
    else:
        got = comm.recv(torch.empty(600_000, dtype=i64), left, tag=5)
        comm.send(xs[r], right, tag=5)
    ck.equal("send/recv large", got, xs[left], share=False)
    # irecv posted before the matching send; recv into a non-contiguous tensor
    xs = every(p, (4, 3), f32, ck.next())
    req = comm.irecv(torch.empty(4, 3), left, tag=7)
    comm.isend(xs[r], right, tag=7).wait()
    req.wait()
    ck.true("irecv done after wait", req.done())
    target = torch.empty(3, 4).t()  # (4, 3), receives a transposed (non-contiguous) send
    comm.isend(xs[r].t().contiguous().t(), right, tag=8).wait()
    ck.equal("recv non-contiguous", comm.recv(target, left, tag=8), xs[left], share=False)
    sent = comm.isend(xs[r].t(), right, tag=9)
    got = comm.recv(torch.empty(3, 4), left, tag=9)
    sent.wait()
    ck.equal("send non-contiguous", got, xs[left].t(), share=False)


def check_barrier(comm: Communicator, ck: Checks) -> None:
    p, r = comm.size, comm.rank
    if p == 1:
        comm.barrier()
        return
    comm.allreduce(torch.zeros(1))  # leave together (within milliseconds)
    start = time.monotonic()
    if r == p - 1:
        time.sleep(0.5)
    comm.barrier()
    waited = time.monotonic() - start
    ck.true("barrier waits for the last rank", r == p - 1 or waited > 0.3, f"{waited:.3f} s")


def check_structure(comm: Communicator, ck: Checks) -> None:
    """Ring talks only to its right neighbour; halving-doubling only to rank ^ 2^k.

    Counted from this rank's own sends: receives may already include messages of the next
    call from a faster rank. The mismatch check's exchange (one message to every peer) is
    measured on an empty allreduce and subtracted; it is zero with PLAIT_CHECK=0.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return

    def sent(fn: Callable[[], object]) -> dict[int, int]:
        before = comm.engine.counts()
        fn()
        after = comm.engine.counts()
        return {q: after[q][0] - before[q][0] for q in after}

    base = sent(lambda: comm.allreduce(torch.ones(0), algorithm="ring"))
    check_off = os.environ.get("PLAIT_CHECK") == "0"
    want_base = {q: 0 if check_off else 1 for q in base}
    ck.true("the mismatch check sends one message per peer", base == want_base, base)
    x = torch.ones(64)
    for algo in ("ring", "halving_doubling"):
        if algo == "halving_doubling" and p & (p - 1):
            continue  # the non-power-of-two fold adds partners
        got = sent(lambda a=algo: comm.allreduce(x, algorithm=a))
        got = {q: n - base[q] for q, n in got.items() if n - base[q]}
        if algo == "ring":
            want = {(r + 1) % p: 2 * (p - 1)}  # p-1 reduce-scatter steps, p-1 all-gather
        else:
            want = {r ^ m: 2 for m in (1 << k for k in range(p.bit_length() - 1))}
        ck.true(f"{algo} messages sent per peer", got == want, f"{got} != {want}")


def check_split(comm: Communicator, ck: Checks) -> None:
    p, r = comm.size, comm.rank
    # by ranks, in an order other than the parent's
    members = [p - 1, 0] if p > 1 else [0]
    sub = comm.split(members)
    if r in members:
        assert sub is not None
        want = (members.index(r), len(members), members.index(r), len(members), 0, 1)
        got = (sub.rank, sub.size, sub.local_rank, sub.local_size, sub.node_rank, sub.num_nodes)
        ck.true("split(ranks) attributes", got == want, f"{got} != {want}")
        sub_battery(sub, ck, "split-ranks/")
    else:
        ck.true("split(ranks) gives None to others", sub is None, sub)
    # by colour, ordered by key (here: reversed)
    color = r % 2
    members = sorted((q for q in range(p) if q % 2 == color), key=lambda q: -q)
    sub = comm.split(color=color, key=-r)
    assert sub is not None
    ck.true("split(color) attributes", (sub.rank, sub.size) == (members.index(r), len(members)))
    sub_battery(sub, ck, f"color{color}/")
    # color=None: no communicator for this rank; then split a sub-communicator again
    sub = comm.split(color=None if r == p - 1 and p > 1 else 7)
    ck.true("split(color=None)", (sub is None) == (r == p - 1 and p > 1), sub)
    if sub is not None:
        ck.true("split(color) size", sub.size == max(p - 1, 1), sub)
        inner = sub.split(color=0, key=-sub.rank)
        assert inner is not None
        ck.true("nested split", (inner.rank, inner.size) == (sub.size - 1 - sub.rank, sub.size))
        xs = every(inner.size, (2, 3), f32, 10**6)  # not ck.next(): rank p-1 is not here
        got = inner.allreduce(xs[inner.rank], algorithm="native")
        ck.equal("nested allreduce", got, reduced(xs, "sum"), share=False)
        got = inner.allgather(xs[inner.rank], algorithm="native")
        ck.equal("nested allgather", got, torch.cat(xs), share=False)
    # the parent still works, and its sequence matches on every rank
    xs = every(p, (3,), f32, ck.next())
    ck.equal("allreduce after split", comm.allreduce(xs[r]), reduced(xs, "sum"))


def sub_battery(sub: Communicator, ck: Checks, scope: str) -> None:
    outer, seed = ck.scope, ck.seed
    ck.scope = outer + scope
    check_allreduce(sub, ck, [f32, torch.int32])
    check_broadcast_reduce(sub, ck, [f32])
    check_gathers(sub, ck, [f32])
    check_p2p_and_objects(sub, ck)
    check_barrier(sub, ck)
    ck.scope, ck.seed = outer, seed  # members of other sub-communicators drew other seeds

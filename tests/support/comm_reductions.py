"""The Communicator's reductions checked on one rank of a world: allreduce in every form, async
calls, the routing table's rows, broadcast and reduce."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from plait import Communicator
from support.comm_checks import (
    ALLREDUCE,
    BROADCAST,
    OPS,
    Checks,
    check_rooted,
    every,
    f32,
    i64,
    reduced,
)


def check_allreduce(comm: Communicator, ck: Checks, dtypes: list[torch.dtype]) -> None:
    p, r = comm.size, comm.rank
    for algo in ALLREDUCE:
        for dtype in dtypes:
            for op in OPS:
                xs = every(p, (4, 3), dtype, ck.next())
                x = xs[r].clone()
                name = f"allreduce {algo} {dtype} {op}"
                ck.equal(name, comm.allreduce(x, op=op, algorithm=algo), reduced(xs, op))
                ck.equal(f"{name}: input unchanged", x, xs[r], share=False)
        # zero elements, fewer elements than ranks, a scalar
        for shape in [(0,), (0, 3), (1,), (2,), (), (p + 1,)]:
            xs = every(p, shape, i64, ck.next())
            got = comm.allreduce(xs[r], op="avg", algorithm=algo)
            ck.equal(f"allreduce {algo} shape {shape}", got, reduced(xs, "avg"))
        # non-contiguous (a transpose), into a new tensor and in place
        bases = every(p, (3, 5), f32, ck.next())
        x = bases[r].clone()
        got = comm.allreduce(x.t(), algorithm=algo)
        ck.equal(f"allreduce {algo} transposed", got, reduced([b.t() for b in bases], "sum"))
        view = x.t()
        out = comm.allreduce_(view, op="max", algorithm=algo)
        ck.true(f"allreduce_ {algo} returns its argument", out is view)
        ck.equal(f"allreduce_ {algo} transposed", x, reduced(bases, "max"))
        # random floats: rounding depends on the order, but every rank must agree
        g = torch.Generator().manual_seed(ck.next())
        xs = [torch.randn(1001, generator=g) for _ in range(p)]
        got = comm.allreduce(xs[r], algorithm=algo)
        ck.close(f"allreduce {algo} randn", got, torch.stack(xs).double().sum(0).float())
    # several ring segments per block (segments shrunk so the tensor stays small)
    from plait.comm.algorithms import ring

    default, ring.DEFAULT_SEGMENT_BYTES = ring.DEFAULT_SEGMENT_BYTES, 64 << 10
    try:
        xs = every(p, (400_000,), f32, ck.next())
        want = reduced(xs, "sum")
        for algo in ("native", "ring", "halving_doubling"):
            ck.equal(f"allreduce {algo} large", comm.allreduce(xs[r], algorithm=algo), want)
    finally:
        ring.DEFAULT_SEGMENT_BYTES = default


def check_async(comm: Communicator, ck: Checks) -> None:
    p, r = comm.size, comm.rank
    cases = [("ring", "sum"), ("native", "max"), ("halving_doubling", "avg"), ("tree", "prod")]
    cases += [(algo, "sum") for algo in ALLREDUCE]
    inputs = [every(p, (3 + i, 2), f32 if i % 2 else i64, ck.next()) for i in range(len(cases))]
    copies = [xs[r].clone() for xs in inputs]
    handles = []
    for i, (algo, op) in enumerate(cases):
        if i % 2:  # in place
            handles.append(comm.allreduce_async_(copies[i], op=op, algorithm=algo))
        else:
            handles.append(comm.allreduce_async(copies[i], op=op, algorithm=algo))
    bs = every(p, (5,), f32, ck.next())
    ck.equal("broadcast behind async calls", comm.broadcast(bs[r], root=p - 1), bs[p - 1])
    # calls run in issue order: those issued before the broadcast have finished
    ck.true("async done before a later blocking call returns", all(h.done() for h in handles))
    for i in reversed(range(len(cases))):  # wait in any order
        algo, op = cases[i]
        got = handles[i].wait()
        ck.equal(f"allreduce_async {algo} {op} #{i}", got, reduced(inputs[i], op))
        if i % 2:
            ck.true(f"allreduce_async_ #{i} returns its argument", got is copies[i])
        else:
            ck.equal(f"allreduce_async #{i}: input unchanged", copies[i], inputs[i][r], False)
        ck.true(f"handle #{i} done after wait", handles[i].done())


def check_async_forms(comm: Communicator, ck: Checks) -> None:
    """Every collective's async forms give what its blocking forms give, issued all at once
    and waited for in reverse; in-place forms return their argument."""
    p, r = comm.size, comm.rank
    root = p - 1
    xs = every(p, (2 * p + 1, 3), i64, ck.next())  # rows split unevenly for p > 1
    x = xs[r].clone()
    ys = {name: x.clone() for name in ("broadcast_", "reduce_")}

    def calls(
        form: str,
    ) -> dict[str, Callable[[], Any]]:  # name -> the call in the blocking or async form
        a = "_async" if form == "async" else ""
        return {
            "broadcast": lambda: getattr(comm, f"broadcast{a}")(x, root),
            "broadcast_": lambda: getattr(comm, f"broadcast{a}_")(ys["broadcast_"], root),
            "reduce": lambda: getattr(comm, f"reduce{a}")(x, root, "max"),
            "reduce_": lambda: getattr(comm, f"reduce{a}_")(ys["reduce_"], root, "min"),
            "allgather": lambda: getattr(comm, f"allgather{a}")(x),
            "reduce_scatter": lambda: getattr(comm, f"reduce_scatter{a}")(x, "avg"),
            "alltoall": lambda: getattr(comm, f"alltoall{a}")(x),
            "gather": lambda: getattr(comm, f"gather{a}")(x, root),
            "scatter": lambda: getattr(comm, f"scatter{a}")(x if r == root else None, root),
            "barrier": lambda: getattr(comm, f"barrier{a}")(),
        }

    requests = {name: call() for name, call in calls("async").items()}
    later = comm.allreduce(torch.ones(1))  # behind every queued call
    ck.true("async calls done before a later blocking one returns",
            all(q.done() for q in requests.values()) and later.item() == p)  # fmt: skip
    got = {name: requests[name].wait() for name in reversed(list(requests))}
    in_place = {name: y.clone() for name, y in ys.items()}
    for y in ys.values():
        y.copy_(x)
    blocking = {name: call() for name, call in calls("blocking").items()}
    want: dict[str, torch.Tensor | None] = {
        "broadcast": xs[root],
        "broadcast_": xs[root],
        "reduce": reduced(xs, "max") if r == root else None,
        "reduce_": reduced(xs, "min") if r == root else None,
        "allgather": torch.cat(xs),
        "reduce_scatter": reduced(xs, "avg").tensor_split(p)[r],
        "alltoall": torch.cat([q.tensor_split(p)[r] for q in xs]),
        "gather": torch.cat(xs) if r == root else None,
        "scatter": xs[root].tensor_split(p)[r],
        "barrier": None,
    }
    for name, w in want.items():
        check_rooted(ck, f"{name}_async", got[name], w)
        check_rooted(ck, f"{name} (blocking)", blocking[name], w)
    ck.true("broadcast_async_ returns its argument", got["broadcast_"] is ys["broadcast_"])
    ck.equal("broadcast_async_ in place", in_place["broadcast_"], xs[root], share=False)
    mine = reduced(xs, "min") if r == root else xs[r]  # untouched off the root
    ck.equal("reduce_async_ in place", in_place["reduce_"], mine, share=False)
    ck.equal("async forms leave their input unchanged", x, xs[r], share=False)


def check_routes(comm: Communicator, ck: Checks) -> None:
    """The Communicator runs the routing table's rows: with every row replaced by a spy,
    each algorithm (auto too) runs the row `routes` names, and gives the exact answer."""
    from plait.comm.dispatch import auto, routes

    p, r = comm.size, comm.rank
    ran: list[tuple[str, str]] = []
    saved = dict(routes.ROUTES)

    def spy(key: tuple[str, str], route: routes.Route) -> routes.Route:
        def run(*args: Any) -> Any:
            ran.append(key)
            return route.run(*args)

        return dataclasses.replace(route, run=run)

    xs = every(p, (2 * p + 1, 3), i64, ck.next())  # uneven blocks: native falls back
    wants: dict[str, tuple[Callable[[str], object], torch.Tensor | None]] = {
        "allreduce": (lambda a: comm.allreduce(xs[r], "sum", a), reduced(xs, "sum")),
        "broadcast": (lambda a: comm.broadcast(xs[r], 0, a), xs[0]),
        "reduce": (
            lambda a: comm.reduce(xs[r], p - 1, "prod", a),
            reduced(xs, "prod") if r == p - 1 else None,
        ),
        "allgather": (lambda a: comm.allgather(xs[r], a), torch.cat(xs)),
        "reduce_scatter": (
            lambda a: comm.reduce_scatter(xs[r], "max", a),
            reduced(xs, "max").tensor_split(p)[r],
        ),
    }
    ck.true("every collective with an algorithm is checked", set(wants) == set(routes.COLLECTIVES))
    routes.ROUTES.update({k: spy(k, v) for k, v in saved.items()})
    try:
        for collective, (call, want) in wants.items():
            usable = routes.usable(collective, comm.topology)
            for algo in ("auto", *usable):
                ran.clear()
                check_rooted(ck, f"{collective} {algo} (spied)", call(algo), want)
                chosen = auto.choose(collective, xs[r].nbytes, comm.topology)
                row = chosen if algo == "auto" else algo
                first = ran[:1] if p > 1 else ran  # a world of one runs no row
                expect = [(collective, row)] if p > 1 else []
                ck.true(f"{collective} {algo} runs row {row}", first == expect, ran)
    finally:
        routes.ROUTES.update(saved)


def check_broadcast_reduce(comm: Communicator, ck: Checks, dtypes: list[torch.dtype]) -> None:
    p, r = comm.size, comm.rank
    for algo in BROADCAST:
        for root in range(p):
            for dtype in dtypes:
                xs = every(p, (3, 2), dtype, ck.next())
                x = xs[r].clone()
                got = comm.broadcast(x, root=root, algorithm=algo)
                ck.equal(f"broadcast {algo} root {root} {dtype}", got, xs[root])
                ck.equal(f"broadcast {algo}: input unchanged", x, xs[r], share=False)
            for i, op in enumerate(OPS):
                dtype = dtypes[(root + i) % len(dtypes)]
                xs = every(p, (2, 3), dtype, ck.next())
                x = xs[r].clone()
                got = comm.reduce(x, root=root, op=op, algorithm=algo)
                name = f"reduce {algo} root {root} {dtype} {op}"
                check_rooted(ck, name, got, reduced(xs, op) if r == root else None)
                ck.equal(f"{name}: input unchanged", x, xs[r], share=False)
        # in place into a non-contiguous view; zero elements; fewer elements than ranks
        bases = every(p, (3, 4), f32, ck.next())
        x = bases[r].clone()
        view = x.t()
        ck.true(
            f"broadcast_ {algo} returns its argument", comm.broadcast_(view, p - 1, algo) is view
        )
        ck.equal(f"broadcast_ {algo} transposed", x, bases[p - 1])
        for shape in [(0, 2), (1,), ()]:
            xs = every(p, shape, f32, ck.next())
            ck.equal(f"broadcast {algo} shape {shape}", comm.broadcast(xs[r], 0, algo), xs[0])
            got = comm.reduce(xs[r], root=p - 1, op="sum", algorithm=algo)
            want = reduced(xs, "sum") if r == p - 1 else None
            check_rooted(ck, f"reduce {algo} shape {shape}", got, want)
        got = comm.reduce(bases[r].t(), root=0, op="min", algorithm=algo)
        want = reduced([b.t() for b in bases], "min") if r == 0 else None
        check_rooted(ck, f"reduce {algo} transposed", got, want)
        # in place on the root (into a non-contiguous view); untouched elsewhere
        x = bases[r].clone()
        view = x.t()
        got = comm.reduce_(view, root=p - 1, op="max", algorithm=algo)
        if r == p - 1:
            ck.true(f"reduce_ {algo} returns its argument on the root", got is view)
            ck.equal(f"reduce_ {algo} transposed", x, reduced(bases, "max"), share=False)
        else:
            ck.true(f"reduce_ {algo}: None off the root", got is None, got)
            ck.equal(f"reduce_ {algo}: input unchanged", x, bases[r], share=False)

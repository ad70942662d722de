"""The routing table: (collective, algorithm) -> the function that runs it, and what the
algorithm's module says of it.

Every algorithm module lists its rows in a `ROUTES` dict, the rows that run on a GPU over
NCCL in `ON_DEVICE`, and its cost formulas in `COSTS`; this table joins them, in the order
of `SOURCES`, which is also the order error messages list the algorithms. The Communicator
looks a call up here (`algorithm="auto"` first asks auto.py, which weighs the rows that
can run on this topology by their formulas or a calibration), and the benchmark
(bench/collectives/) measures the same rows. A new algorithm is one module, its rows,
and its line in `SOURCES`.

What a row is called with (`ctx` is the call's context, algorithms/context.py: itself the
`Channel` of every rank, so an algorithm written against a channel is its own row; `buf`
is 1-D and contiguous; `op` is sum, prod, min or max: "avg" is a sum the caller divides):

    collective       row                              on return
    allreduce        fn(ctx, buf, op)                 buf holds the reduction
    broadcast        fn(ctx, buf, root)               buf holds root's buf
    reduce           fn(ctx, buf, op, root)           root's buf holds the reduction
                                                      (others' are scratch)
    allgather        fn(ctx, buf, bounds)             buf holds every rank's block
                                                      (rank j's is buf[bounds[j]:bounds[j+1]];
                                                      this rank's was in place before)
    reduce_scatter   fn(ctx, buf, op, bounds) -> t    t: this rank's block of the reduction
                                                      (1-D, its own memory)

Collectives with one algorithm (alltoall, gather, scatter, barrier) call
`algorithms.direct` without the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from plait.comm.algorithms import halving_doubling, hierarchical, native, ring, shm, tree
from plait.comm.algorithms.model import Formula
from plait.comm.core.topology import Topology

#: The collectives that take an `algorithm` argument.
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")


def _anywhere(topology: Topology) -> bool:
    return True


#: (module, where its rows can run). `runs_on` is asked on every `auto` call (PLAIT_SHM
#: may change meanwhile) and by the benchmark (which leaves out what cannot run); a row
#: asked for where it cannot run raises its own error (ShmError) naming what it needs. The
#: rows that run anywhere are the *flat* ones: one level over every rank of any topology.
SOURCES: tuple[tuple[ModuleType, Callable[[Topology], bool]], ...] = (
    (native, _anywhere),
    (ring, _anywhere),
    (halving_doubling, _anywhere),
    (tree, _anywhere),
    (shm, shm.runs_on),
    (hierarchical, hierarchical.runs_on),
)


@dataclass(frozen=True)
class Route:
    """One row: the function; the test of whether it can run on a topology; whether it
    runs on a GPU over NCCL (its module's `ON_DEVICE`; the others are staged through host
    memory: backends/cuda.py); whether it is flat (runs on any topology); and its cost
    formula (its module's `COSTS`), if the model has one."""

    run: Callable[..., Any]
    runs_on: Callable[[Topology], bool]
    on_device: bool
    flat: bool
    cost: Formula | None


def _table() -> dict[tuple[str, str], Route]:
    table: dict[tuple[str, str], Route] = {}
    for module, runs_on in SOURCES:
        for (collective, algorithm), fn in module.ROUTES.items():
            if collective not in COLLECTIVES or (collective, algorithm) in table:
                raise ValueError(
                    f"{module.__name__} lists row ({collective!r}, {algorithm!r}): the "
                    f"collective must be one of {COLLECTIVES} and the row new"
                )
            on_device = (collective, algorithm) in module.ON_DEVICE
            cost = module.COSTS.get(collective)
            table[collective, algorithm] = Route(fn, runs_on, on_device, runs_on is _anywhere, cost)
    return table


ROUTES: dict[tuple[str, str], Route] = _table()

#: Each collective's rows, in table order (so a lookup never scans the other collectives').
ROWS: dict[str, tuple[tuple[str, Route], ...]] = {
    c: tuple((a, r) for (k, a), r in ROUTES.items() if k == c) for c in COLLECTIVES
}

#: What each collective accepts for `algorithm`: "auto", then its rows.
ACCEPTED: dict[str, tuple[str, ...]] = {
    c: ("auto", *(a for a, _ in rows)) for c, rows in ROWS.items()
}


def check(collective: str, algorithm: str) -> str:
    """`algorithm`, if `collective` has a row of that name or it is "auto".

    Raises:
        ValueError: naming every accepted algorithm.
    """
    if algorithm not in ACCEPTED[collective]:
        accepted = ", ".join(map(repr, ACCEPTED[collective]))
        raise ValueError(f"{collective} algorithm must be one of {accepted}; got {algorithm!r}")
    return algorithm


def usable(collective: str, topology: Topology) -> tuple[str, ...]:
    """The algorithms of `collective` that can run on `topology`, in table order."""
    return tuple(a for a, r in ROWS[collective] if r.runs_on(topology))


def flat(collective: str) -> tuple[str, ...]:
    """The flat rows of `collective` (one level over every rank, any topology), in table
    order: what a calibration measures at a world size, and `auto` weighs."""
    return tuple(a for a, r in ROWS[collective] if r.flat)

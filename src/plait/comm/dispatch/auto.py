"""`algorithm="auto"`: pick the algorithm with the lowest predicted time.

The prediction is the alpha-beta(-gamma) model of Thakur, Rabenseifner & Gropp (2005) for
p ranks and n bytes (alpha: per-message latency, beta: seconds per byte on the wire,
gamma: seconds per byte reduced). Each algorithm's module carries its formula, and the
routing table its row's (`Route.cost`):

    ring              2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
    halving_doubling  2 lg p a + 2(p-1)/p n b + (p-1)/p n g   (+ 2a + 2nb + ng to fold p
                                                                 onto a power of two)
    tree              2 lg p (a + n b) + lg p n g              (binomial reduce + bcast)

`native` (gloo) gets its own alpha and beta. Calibration (`plait bench collectives
--calibrate`, calibration.py) replaces the defaults with measurements of every algorithm at
several sizes at this world size; between two measured sizes the time is the alpha-beta
line through them. That captures what the formulas miss (CPU contention when ranks
outnumber cores, Python overhead per message).

The candidates are the routing table's rows that can run on the communicator's topology
(routes.usable); `AUTO` maps each collective to its chooser, which `choose` calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from plait.comm.algorithms import hierarchical
from plait.comm.algorithms.model import DEFAULT, NETWORK, AlphaBeta, Formula
from plait.comm.backends import cuda
from plait.comm.core.topology import Topology
from plait.comm.dispatch import routes
from plait.comm.dispatch.calibration import interpolate, load_calibration, load_levels, world_key

#: The order ties go among the flat rows: tree moves the fewest messages in all (2(p-1)),
#: which counts when ranks outnumber cores and every message costs a wake-up. A flat row
#: not named here comes after these, in table order.
PREFERENCE = ("tree", "halving_doubling", "ring", "native")


def _by_preference(rows: tuple[str, ...]) -> tuple[str, ...]:
    rank = {a: i for i, a in enumerate(PREFERENCE)}
    return tuple(sorted(rows, key=lambda a: rank.get(a, len(PREFERENCE))))


#: Each collective's flat rows (routes.flat), in the order ties go.
FLAT: dict[str, tuple[str, ...]] = {c: _by_preference(routes.flat(c)) for c in routes.COLLECTIVES}


#: Each collective's cost formulas (its rows' `Route.cost`), by algorithm.
COSTS: dict[str, dict[str, Formula]] = {
    c: {a: r.cost for a, r in routes.ROWS[c] if r.cost is not None} for c in routes.COLLECTIVES
}


def predict(algorithm: str, n: int, p: int, params: AlphaBeta = DEFAULT) -> float:
    """Predicted seconds for an allreduce of n bytes over p ranks, by the algorithm's own
    formula.

    Raises:
        ValueError: the model has no formula for `algorithm`.
    """
    formula = COSTS["allreduce"].get(algorithm)
    if formula is None:
        raise ValueError(f"no cost model for {algorithm!r}")
    return formula(n, p, params)


#: Leave the baseline (gloo) only for a predicted gain of more than 10%. Repeated
#: calibrations here scatter by about that much, and where two algorithms are that close
#: a coin-flip choice could only lose against the baseline, never win by much.
SWITCH_MARGIN = 0.9


def _cost(collective: str, algorithm: str, n: int, topology: Topology, params: AlphaBeta) -> float:
    """Calibrated seconds of `algorithm` at n bytes on this world, else the model's."""
    world = world_key(topology.size, topology.num_nodes)
    measured = load_calibration().get(world, {}).get(collective)
    if measured and measured.get(algorithm):
        return interpolate(measured[algorithm], n)
    if algorithm == "hierarchical":  # two levels: measured per level, else its own formula
        levels = load_levels(topology.size, topology.num_nodes)
        if levels is not None:  # measured per level: t_local(n) + t_network(n)
            (a1, b1), (a2, b2) = levels["local"], levels["network"]
            return a1 + b1 * n + a2 + b2 * n
        local, cross = topology.levels or ([], [])
        return hierarchical.allreduce_cost(n, len(cross), len(local), params)
    return predict(algorithm, n, topology.size, params)


def _best(collective: str, candidates: tuple[str, ...], n: int, topology: Topology) -> str:
    world = world_key(topology.size, topology.num_nodes)
    measured = load_calibration().get(world, {}).get(collective)
    if measured and all(measured.get(c) for c in candidates):
        cost = {c: interpolate(measured[c], n) for c in candidates}
    else:  # each candidate's formula (predict's, without its lookup: `auto` runs per call)
        p, formulas = topology.size, COSTS["allreduce"]
        cost = {c: formulas[c](n, p, DEFAULT) for c in candidates}
    best = min(candidates, key=cost.__getitem__)
    if "native" in cost and cost[best] > SWITCH_MARGIN * cost["native"]:
        return "native"
    return best


def allreduce(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The allreduce algorithm for n bytes among the `usable` rows: shared memory when every
    rank shares a host, else by the cost model."""
    if "shm" in usable:
        return "shm"
    flat = tuple(a for a in FLAT["allreduce"] if a in usable)
    if topology.num_nodes == 1:
        return _best("allreduce", flat, n, topology)
    # across hosts: the network model (or this world's calibration) for every candidate,
    # the two-level algorithm among them where the hosts hold equal numbers of ranks
    candidates = flat + tuple(a for a in ("hierarchical",) if a in usable)
    return min(candidates, key=lambda a: _cost("allreduce", a, n, topology, NETWORK))


#: Each collective's flat rows that have a formula, with it, in the order ties go.
_COSTED: dict[str, tuple[tuple[str, Formula], ...]] = {
    c: tuple((a, COSTS[c][a]) for a in FLAT[c] if a in COSTS[c]) for c in routes.COLLECTIVES
}


def _one_way(collective: str, n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """Binomial tree against gloo's, by the model (lg p messages of n bytes each): the flat
    rows with a formula for `collective`, ties going as PREFERENCE says."""
    p = topology.size
    best, least = "", math.inf
    for a, formula in _COSTED[collective]:
        if a in usable:
            cost = formula(n, p, DEFAULT)
            if cost < least:
                best, least = a, cost
    return best


def broadcast(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The broadcast algorithm: shared memory on one host, else binomial tree against
    gloo's, by the model."""
    return "shm" if "shm" in usable else _one_way("broadcast", n, topology, usable)


def reduce(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The reduce algorithm: binomial tree against gloo's, by the model."""
    return _one_way("reduce", n, topology, usable)


def blocks(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """allgather's and reduce_scatter's algorithm: shared memory on one host, the two
    levels across hosts of equal size, else the ring (gloo's needs equal blocks)."""
    for algorithm in ("shm", "hierarchical"):
        if algorithm in usable:
            return algorithm
    return "ring"


#: `algorithm="auto"` per collective: (bytes, topology, the usable rows) -> algorithm.
AUTO: dict[str, Callable[[int, Topology, tuple[str, ...]], str]] = {
    "allreduce": allreduce,
    "broadcast": broadcast,
    "reduce": reduce,
    "allgather": blocks,
    "reduce_scatter": blocks,
}


def on_cuda(collective: str, n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """`auto` for CUDA tensors over NCCL: NCCL's own collective, unless a calibration taken on
    CUDA at this world size (`plait bench collectives --device cuda --calibrate`) measured
    every candidate (the usable flat rows that run on the GPU) and one beats NCCL by more
    than the switch margin. The cost model's formulas describe CPU links, so without a
    calibration there is nothing to weigh."""
    world = world_key(topology.size, topology.num_nodes, "cuda")
    measured = load_calibration().get(world, {}).get(collective)
    rows = routes.ROUTES
    candidates = tuple(
        a for a in usable if rows[collective, a].flat and rows[collective, a].on_device
    )
    if not measured or "native" not in candidates or not all(measured.get(c) for c in candidates):
        return "native"
    cost = {c: interpolate(measured[c], n) for c in candidates}
    best = min(candidates, key=cost.__getitem__)
    return best if cost[best] <= SWITCH_MARGIN * cost["native"] else "native"


def choose(
    collective: str, nbytes: int, topology: Topology, device: torch.device | None = None
) -> str:
    """What `algorithm="auto"` runs for `nbytes` on `topology`: the cost model's pick among
    the usable rows; for CUDA tensors over NCCL, NCCL's unless a CUDA calibration says
    otherwise (staged CUDA tensors run the CPU rows, so they choose as CPU ones do)."""
    rows = routes.usable(collective, topology)
    if device is not None and device.type != "cpu" and cuda.transport(device) == "nccl":
        return on_cuda(collective, nbytes, topology, rows)
    return AUTO[collective](nbytes, topology, rows)


def resolve(collective: str, algorithm: str, t: torch.Tensor, topology: Topology) -> str:
    """`algorithm` (already checked), "auto" resolved for tensor `t` (its bytes and device)."""
    if algorithm != "auto":
        return algorithm
    if t.is_cpu:  # the three-argument call tests replace; and no torch.device built (1.5 us)
        return choose(collective, t.nbytes, topology)
    return choose(collective, t.nbytes, topology, t.device)

"""`algorithm="auto"`: pick the algorithm with the lowest predicted time.

The prediction is the alpha-beta(-gamma) model of Thakur, Rabenseifner & Gropp (2005) for
p ranks and n bytes (alpha: per-message latency, beta: seconds per byte on the wire,
gamma: seconds per byte reduced):

    ring              2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
    halving_doubling  2 lg p a + 2(p-1)/p n b + (p-1)/p n g   (+ 2a + 2nb + ng to fold p
                                                                 onto a power of two)
    tree              2 lg p (a + n b) + lg p n g              (binomial reduce + bcast)

`native` (gloo) gets its own alpha and beta. Calibration (`plait bench collectives
--calibrate`) replaces the defaults with measurements of every algorithm at several sizes
at this world size; between two measured sizes the time is the alpha-beta line through
them. That captures what the formulas miss (CPU contention when ranks outnumber cores,
Python overhead per message).

The candidates are the routing table's rows that can run on the communicator's topology
(routes.usable); `AUTO` maps each collective to its chooser, which routes.choose calls.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait import env

if TYPE_CHECKING:
    from plait.comm.core.topology import Topology


@dataclass(frozen=True, kw_only=True)
class Link:
    """Cost parameters of one kind of link (seconds, seconds per byte)."""

    # Defaults read off this project's 2-core machine at 4 ranks (plait bench collectives):
    # per-message latency is dominated by process wake-ups, and gloo's far more so.
    alpha: float = 300e-6
    beta: float = 1 / 0.8e9
    gamma: float = 1 / 4e9
    native_alpha: float = 1e-3
    native_beta: float = 1 / 1.6e9


DEFAULT = Link()

#: Across hosts every algorithm's bytes cross the same network, plait's and gloo's alike:
#: a 1 Gbit/s link with 100 us per message (the multi-host test network's rate).
NETWORK = Link(alpha=100e-6, beta=8 / 1e9, native_alpha=100e-6, native_beta=8 / 1e9)


def predict(algorithm: str, n: int, p: int, link: Link = DEFAULT) -> float:
    """Predicted seconds for an allreduce of n bytes over p ranks."""
    a, b, g = link.alpha, link.beta, link.gamma
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    share = (p - 1) / p
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * share * n * b + share * n * g
    if algorithm == "halving_doubling":
        fold = 0.0 if p & (p - 1) == 0 else 2 * a + 2 * n * b + n * g
        return 2 * math.floor(math.log2(p)) * a + 2 * share * n * b + share * n * g + fold
    if algorithm == "tree":
        return 2 * lg * (a + n * b) + lg * n * g
    if algorithm == "native":
        return 2 * (p - 1) * link.native_alpha + 2 * share * n * link.native_beta + share * n * g
    raise ValueError(f"no cost model for {algorithm!r}")


#: The shared-memory level of the hierarchical model (this machine, 4 ranks on 2 cores):
#: seconds per synchronisation of a host's ranks, and seconds per byte for the host's
#: reduce-scatter and all-gather together.
SHM_SYNC = 50e-6
SHM_BETA = 1 / 2e9


def save_levels(size: int, num_nodes: int, levels: dict[str, tuple[float, float]]) -> Path:
    """Save the measured (alpha, beta) of each level of this world ("local", "network")."""

    def change(data: dict[str, Any]) -> None:
        data.setdefault("points", {})
        data.setdefault("levels", {})[world_key(size, num_nodes)] = {
            k: list(v) for k, v in levels.items()
        }

    return _rewrite(change)


def load_levels(size: int, num_nodes: int) -> dict[str, list[float]] | None:
    """The saved levels of this world, or None."""
    levels = _read().get("levels")
    found = levels.get(world_key(size, num_nodes)) if isinstance(levels, dict) else None
    return found if isinstance(found, dict) and {"local", "network"} <= found.keys() else None


def predict_hierarchical(n: int, hosts: int, local: int, link: Link = DEFAULT) -> float:
    """Predicted seconds of the two-level allreduce of n bytes over `hosts` x `local` ranks.

    The host level (reduce-scatter, all-gather) takes local + 3 synchronisations and
    SHM_BETA per byte; the network level is the best flat allreduce of n / local bytes over
    `hosts` ranks, with the link's bandwidth divided among the `local` groups that share it
    (so its bandwidth term is that of n bytes).
    """
    shared = Link(alpha=link.alpha, beta=link.beta * local, gamma=link.gamma)
    cross = min(predict(a, n // local, hosts, shared) for a in ("ring", "halving_doubling", "tree"))
    return (local + 3) * SHM_SYNC + n * SHM_BETA + cross


def cross_allreduce(n: int, hosts: int) -> str:
    """The flat allreduce between hosts in the hierarchical one (n bytes per group)."""
    return min(("tree", "halving_doubling", "ring"), key=lambda a: predict(a, n, hosts))


def calibration_path() -> Path:
    """Where calibration lives: $PLAIT_CALIBRATION, else ~/.cache/plait/calibration.json."""
    path = env.get("PLAIT_CALIBRATION")
    if path:
        return Path(path)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "plait"
        / "calibration.json"
    )


Points = list[list[float]]  # [[bytes, seconds], ...], ascending in bytes
_file: dict[str, Any] | None = None  # the calibration file as last read
_stamp: tuple[str, int, int, int] | None = None  # (path, inode, mtime_ns, size) of that read


def _read(reload: bool = False) -> dict[str, Any]:
    """The calibration file's contents ({} if none), parsed again only when the file changed.

    `auto` asks on every call, and parsing the file there cost more than some collectives
    (~50 us); a stat costs ~1 us. The file must be re-read when it changes: every rank has to
    choose the same algorithm for the same call (a rank choosing otherwise waits for messages
    its peers never send), and rank 0 rewrites the file while calibrating.
    """
    global _file, _stamp
    path = calibration_path()
    try:
        st = path.stat()
        # a rewrite is a new file (os.replace): its inode changes even within one mtime tick
        stamp: tuple[str, int, int, int] | None = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    if _file is None or reload or stamp != _stamp:
        try:
            data = json.loads(path.read_text()) if stamp is not None else {}
        except (OSError, ValueError):
            data = {}
        _file, _stamp = (data if isinstance(data, dict) else {}), stamp
    return _file


def _rewrite(change: Callable[[dict[str, Any]], None]) -> Path:
    """Apply `change` to the calibration file's contents as they are now, write them back
    atomically, and read them again."""
    data = _read(reload=True)
    change(data)
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    _read(reload=True)
    return path


def load_calibration(reload: bool = False) -> dict[str, dict[str, dict[str, Points]]]:
    """{world key: {collective: {algorithm: [[bytes, seconds], ...]}}}; {} if never calibrated."""
    points: dict[str, dict[str, dict[str, Points]]] = _read(reload).get("points", {})
    return points


def world_key(size: int, num_nodes: int, device: str = "cpu") -> str:
    """The calibration's key of a world: "p4-n1" for CPU tensors, "cuda-p4-n1" for CUDA ones."""
    key = f"p{size}-n{num_nodes}"
    return key if device == "cpu" else f"{device}-{key}"


def interpolate(points: Points, n: float) -> float:
    """Measured time at n bytes: the alpha-beta line through the two nearest calibrated
    sizes (a local alpha and beta; one global line misjudges the middle sizes, where the
    algorithms cross over), extended beyond the ends."""
    if len(points) == 1:
        return points[0][1]
    i = 0
    while i < len(points) - 2 and n > points[i + 1][0]:
        i += 1
    (n0, t0), (n1, t1) = points[i], points[i + 1]
    beta = max(0.0, (t1 - t0) / (n1 - n0)) if n1 != n0 else 0.0
    return max(t0 + beta * (n - n0), 1e-9)


#: Leave the baseline (gloo) only for a predicted gain of more than 10%. Repeated
#: calibrations here scatter by about that much, and where two algorithms are that close
#: a coin-flip choice could only lose against the baseline, never win by much.
SWITCH_MARGIN = 0.9


def _cost(collective: str, algorithm: str, n: int, topology: Topology, link: Link) -> float:
    """Calibrated seconds of `algorithm` at n bytes on this world, else the model's."""
    world = world_key(topology.size, topology.num_nodes)
    measured = load_calibration().get(world, {}).get(collective)
    if measured and measured.get(algorithm):
        return interpolate(measured[algorithm], n)
    if algorithm == "hierarchical":
        levels = load_levels(topology.size, topology.num_nodes)
        if levels is not None:  # measured per level: t_local(n) + t_network(n)
            (a1, b1), (a2, b2) = levels["local"], levels["network"]
            return a1 + b1 * n + a2 + b2 * n
        local, cross = topology.levels or ([], [])
        return predict_hierarchical(n, len(cross), len(local), link)
    return predict(algorithm, n, topology.size, link)


def _best(collective: str, candidates: tuple[str, ...], n: int, topology: Topology) -> str:
    world = world_key(topology.size, topology.num_nodes)
    measured = load_calibration().get(world, {}).get(collective)
    if measured and all(measured.get(c) for c in candidates):
        cost = {c: interpolate(measured[c], n) for c in candidates}
    else:
        cost = {c: predict(c, n, topology.size) for c in candidates}
    best = min(candidates, key=cost.__getitem__)
    if "native" in cost and cost[best] > SWITCH_MARGIN * cost["native"]:
        return "native"
    return best


#: The flat algorithms the model has formulas for, in the order ties go: tree moves the
#: fewest messages in all (2(p-1)), which counts when ranks outnumber cores and every
#: message costs a wake-up.
FLAT = ("tree", "halving_doubling", "ring", "native")


def allreduce(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The allreduce algorithm for n bytes among the `usable` rows: shared memory when every
    rank shares a host, else by the cost model."""
    if "shm" in usable:
        return "shm"
    flat = tuple(a for a in FLAT if a in usable)
    if topology.num_nodes == 1:
        return _best("allreduce", flat, n, topology)
    # across hosts: the network model (or this world's calibration) for every candidate,
    # the two-level algorithm among them where the hosts hold equal numbers of ranks
    candidates = flat + tuple(a for a in ("hierarchical",) if a in usable)
    return min(candidates, key=lambda a: _cost("allreduce", a, n, topology, NETWORK))


def _tree_or_native(n: int, topology: Topology) -> str:
    """Binomial tree against gloo's, by the model (lg p messages of n bytes each)."""
    lg = math.ceil(math.log2(topology.size)) if topology.size > 1 else 0
    tree = lg * (DEFAULT.alpha + n * DEFAULT.beta)
    gloo = lg * (DEFAULT.native_alpha + n * DEFAULT.native_beta)
    return "tree" if tree <= gloo else "native"


def broadcast(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The broadcast algorithm: shared memory on one host, else binomial tree against
    gloo's, by the model."""
    return "shm" if "shm" in usable else _tree_or_native(n, topology)


def reduce(n: int, topology: Topology, usable: tuple[str, ...]) -> str:
    """The reduce algorithm: binomial tree against gloo's, by the model."""
    return _tree_or_native(n, topology)


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
    every candidate and one beats NCCL by more than the switch margin. The cost model's
    formulas describe CPU links, so without a calibration there is nothing to weigh."""
    world = world_key(topology.size, topology.num_nodes, "cuda")
    measured = load_calibration().get(world, {}).get(collective)
    candidates = tuple(a for a in usable if a in ON_CUDA)
    if not measured or "native" not in candidates or not all(measured.get(c) for c in candidates):
        return "native"
    cost = {c: interpolate(measured[c], n) for c in candidates}
    best = min(candidates, key=cost.__getitem__)
    return best if cost[best] <= SWITCH_MARGIN * cost["native"] else "native"


#: The rows that run on the GPU over NCCL (the others are staged through host memory).
ON_CUDA = ("native", "ring", "halving_doubling", "tree")


def save_calibration(
    size: int, num_nodes: int, collective: str, points: dict[str, Points], device: str = "cpu"
) -> Path:
    """Merge one world size's measurements (on `device`'s tensors) into the calibration file
    (atomically)."""

    def change(data: dict[str, Any]) -> None:
        if not isinstance(data.get("points"), dict):
            data["points"] = {}
        data["points"].setdefault(world_key(size, num_nodes, device), {})[collective] = {
            a: sorted(p) for a, p in points.items()
        }
        data["note"] = (
            "median seconds per call at n bytes; written by plait bench collectives --calibrate"
        )

    return _rewrite(change)

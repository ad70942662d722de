"""Mesh: the ranks of a communicator laid on a (dp, pp, tp) grid, one sub-communicator per axis.

Words: an *axis* is a mesh axis (dp, pp or tp); a *dim* is a tensor dimension. tp varies
fastest, then pp, then dp, so tensor-parallel peers (the chattiest: an allreduce per layer)
get neighbouring ranks, which `plait run` and torchrun place on the same host:

    rank = (dp_index * pp + pp_index) * tp + tp_index

    dp=2, pp=2, tp=2 on 8 ranks:   tp groups [0,1] [2,3] [4,5] [6,7]
                                   pp groups [0,2] [1,3] [4,6] [5,7]
                                   dp groups [0,4] [1,5] [2,6] [3,7]
"""

from __future__ import annotations

import warnings

from plait.comm.communicator import Communicator
from plait.comm.core.topology import Topology
from plait.comm.world import init
from plait.errors import PlaitError

AXES = ("dp", "pp", "tp")


class MeshError(PlaitError, ValueError):
    """A mesh whose shape does not fit the communicator."""


def coordinates(rank: int, dp: int, pp: int, tp: int) -> dict[str, int]:
    """The (dp, pp, tp) indices of `rank` on the grid."""
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}


def check_shape(dp: int, pp: int, tp: int, size: int) -> None:
    """Raise MeshError unless every axis is >= 1 and dp * pp * tp equals `size`."""
    for name, n in zip(AXES, (dp, pp, tp), strict=True):
        if not isinstance(n, int) or n < 1:
            raise MeshError(f"mesh axis {name} must be an integer >= 1; got {n!r}")
    if dp * pp * tp != size:
        raise MeshError(f"dp({dp}) * pp({pp}) * tp({tp}) = {dp * pp * tp} != world size {size}")


def hosts_spanned(topology: Topology, dp: int, pp: int, tp: int) -> dict[str, int]:
    """For each axis, the most hosts that one of its groups spans (1: every group of the
    axis lies inside a host). Computed from where every rank runs; nothing is sent."""
    spans = {}
    for axis in AXES:
        groups: dict[tuple[int, ...], set[str]] = {}
        for rank, node in enumerate(topology.nodes):
            at = coordinates(rank, dp, pp, tp)
            groups.setdefault(tuple(at[a] for a in AXES if a != axis), set()).add(node)
        spans[axis] = max(len(hosts) for hosts in groups.values())
    return spans


class Mesh:
    """`comm`'s ranks on a dp x pp x tp grid (`comm`: `plait.init()` when None).

    `mesh.dp`, `mesh.pp`, `mesh.tp` are the sub-communicators of this rank's groups along
    each axis (a rank's position in one is its index on that axis); `mesh.shape` and
    `mesh.coords` give the sizes and this rank's indices. Every rank must construct the mesh
    (it splits the communicator three times).
    """

    def __init__(
        self, dp: int = 1, pp: int = 1, tp: int = 1, comm: Communicator | None = None
    ) -> None:
        if comm is None:
            comm = init()
        check_shape(dp, pp, tp, comm.size)
        self.comm = comm
        self.shape = {"dp": dp, "pp": pp, "tp": tp}
        self.coords = coordinates(comm.rank, dp, pp, tp)
        #: per axis, the most hosts one of its groups spans (Megatron-LM keeps tp in a host)
        self.hosts_spanned = hosts_spanned(comm.topology, dp, pp, tp)
        if self.hosts_spanned["tp"] > 1 and comm.rank == 0:
            warnings.warn(
                f"tensor-parallel groups span {self.hosts_spanned['tp']} hosts: every layer's "
                "allreduce crosses the network. tp varies fastest, so give each host a "
                f"multiple of tp({tp}) ranks",
                stacklevel=2,
            )
        self.groups: dict[str, Communicator] = {}
        for axis in AXES:
            # the ranks of one group agree on every coordinate but this axis's
            others = tuple(self.coords[a] for a in AXES if a != axis)
            color = 0
            for a, c in zip((a for a in AXES if a != axis), others, strict=True):
                color = color * self.shape[a] + c
            group = comm.split(color=color, key=self.coords[axis])
            assert group is not None and group.rank == self.coords[axis]
            self.groups[axis] = group

    @property
    def dp(self) -> Communicator:
        return self.groups["dp"]

    @property
    def pp(self) -> Communicator:
        return self.groups["pp"]

    @property
    def tp(self) -> Communicator:
        return self.groups["tp"]

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.shape[a]}" for a in AXES)
        where = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"Mesh({shape}; rank {self.comm.rank} at {where})"

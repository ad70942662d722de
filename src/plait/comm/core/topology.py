"""Where a communicator's ranks run: which host each is on, and the two levels between them.

Words: a *rank* is a position in the communicator (0..size-1); a *node* or *host* is a
machine (ranks with the same PLAIT_NODE_ID or hostname); a rank's *local rank* is its
position among the ranks of its host, its *node rank* its host's position among the hosts,
hosts in order of their lowest rank. `comm.topology` is one; the cost model (dispatch/auto.py),
the routing table's `runs_on` checks (dispatch/routes.py), the hierarchical algorithms and Mesh
(which hosts each axis's groups span) read it.

    nodes ["b", "a", "b", "c", "a"], rank 2:
        hosts      [[0, 2], [1, 4], [3]]     (b first: it holds rank 0)
        node_rank 0, num_nodes 3, local_rank 1, local_size 2
"""

from __future__ import annotations

from collections.abc import Sequence


class Topology:
    """The hosts of a communicator's ranks, seen from rank `rank`."""

    __slots__ = (
        "hosts",
        "levels",
        "local_rank",
        "local_size",
        "node_rank",
        "nodes",
        "num_nodes",
        "rank",
        "size",
    )

    def __init__(self, nodes: Sequence[str], rank: int) -> None:
        """Args:
        nodes: the host of each rank, in rank order.
        rank: this rank (0 <= rank < len(nodes)).
        """
        if not 0 <= rank < len(nodes):
            raise ValueError(f"rank must be in [0, {len(nodes)}) (one node per rank); got {rank}")
        self.nodes = tuple(nodes)
        self.rank = rank
        self.size = len(nodes)
        order = list(dict.fromkeys(nodes))  # hosts in order of their lowest rank
        me = nodes[rank]
        self.node_rank = order.index(me)
        self.num_nodes = len(order)
        self.local_rank = nodes[:rank].count(me)
        self.local_size = nodes.count(me)
        #: each host's ranks, hosts in node_rank order, ranks ascending (= local rank order)
        self.hosts = tuple(tuple(i for i, n in enumerate(nodes) if n == h) for h in order)
        #: (this host's ranks, the ranks of this local rank on every host), the two groups of
        #: the hierarchical algorithms; None unless there are several hosts with the same
        #: number (> 1) of ranks each. Computed once: `auto` asks on every call.
        self.levels: tuple[list[int], list[int]] | None = None
        sizes = {len(h) for h in self.hosts}
        if self.num_nodes > 1 and len(sizes) == 1 and sizes != {1}:
            local = list(self.hosts[self.node_rank])
            self.levels = local, [h[self.local_rank] for h in self.hosts]

    def __repr__(self) -> str:
        return f"Topology(rank={self.rank}, hosts={[list(h) for h in self.hosts]})"

"""A communicator's topology from its ranks' node names: the hosts, the levels of a hierarchy,
and the attributes (local rank, node rank) a Communicator derives from them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from plait import Communicator
from plait.comm.core.topology import Topology


def test_topology_levels() -> None:
    two_by_two = Topology(["h0", "h0", "h1", "h1"], 3)
    assert two_by_two.hosts == ((0, 1), (2, 3))
    assert two_by_two.levels == ([2, 3], [1, 3])  # this host's ranks, this local rank's
    assert Topology(["h0", "h0", "h1"], 0).levels is None  # hosts of unequal size
    assert Topology(["h0", "h1"], 0).levels is None  # one rank per host: nothing to share
    assert Topology(["h0"] * 4, 0).levels is None  # one host
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        Topology(["a", "b"], 2)


def test_topology_attributes_from_node_names() -> None:
    engine: Any = SimpleNamespace(rank=5)  # only its rank is read when building
    comm = Communicator(engine, [1, 3, 5, 7, 9], ["b", "a", "b", "c", "a"], comm_id=1)
    got = (comm.rank, comm.size, comm.local_rank, comm.local_size, comm.node_rank, comm.num_nodes)
    assert got == (2, 5, 1, 2, 0, 3)  # nodes in order of their lowest rank: b, a, c
    assert "local_rank=1" in repr(comm)

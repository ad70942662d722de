"""plait.Mesh: the grid layout (tp fastest), the hosts each axis spans, and the equation in the
error. Each axis's group, in a world, is in tests/world/test_mesh_groups.py."""

from __future__ import annotations

import pytest

from plait.comm.core.topology import Topology
from plait.comm.mesh import MeshError, check_shape, coordinates, hosts_spanned


def test_tp_varies_fastest_then_pp_then_dp() -> None:
    grid = [coordinates(r, 2, 2, 2) for r in range(8)]
    assert [(c["dp"], c["pp"], c["tp"]) for c in grid] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip


def test_hosts_spanned_per_axis() -> None:
    # 8 ranks, 2 hosts of 4 (ranks 0-3 on "a"): with tp=2 fastest, tp pairs stay in a host;
    # pp pairs (r, r+2) too; dp pairs (r, r+4) cross
    two_hosts = Topology(["a"] * 4 + ["b"] * 4, 0)
    assert hosts_spanned(two_hosts, 2, 2, 2) == {"dp": 2, "pp": 1, "tp": 1}
    # hosts of 2 ranks interleaved a, b, a, b: every tp pair (r, r+1) spans both
    interleaved = Topology(["a", "b"] * 4, 0)
    assert hosts_spanned(interleaved, 2, 2, 2) == {"dp": 1, "pp": 1, "tp": 2}
    one_host = Topology(["a"] * 8, 3)
    assert hosts_spanned(one_host, 2, 2, 2) == {"dp": 1, "pp": 1, "tp": 1}


def test_shape_error_shows_the_equation() -> None:
    with pytest.raises(MeshError, match=r"dp\(2\) \* pp\(2\) \* tp\(2\) = 8 != world size 4"):
        check_shape(2, 2, 2, 4)
    with pytest.raises(MeshError, match="axis pp must be an integer >= 1; got 0"):
        check_shape(4, 0, 1, 4)

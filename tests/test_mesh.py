"""plait.Mesh: the grid layout (tp fastest), the equation in the error, and each axis's group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait import Communicator, Mesh
from plait.comm.core.topology import Topology
from plait.comm.mesh import MeshError, check_shape, coordinates, hosts_spanned
from support.world import run_world


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


def _layouts(comm: Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dp, pp, tp in ((2, 1, 2), (1, 2, 2), (4, 1, 1), (1, 1, 4)):
        mesh = Mesh(dp=dp, pp=pp, tp=tp, comm=comm)
        # structure: which global ranks share each group, and a collective along each axis
        out[f"{dp}{pp}{tp}"] = {
            axis: (group.ranks, group.allreduce(torch.tensor([comm.rank])).item())
            for axis, group in mesh.groups.items()
        }
    try:
        Mesh(dp=2, pp=2, tp=2, comm=comm)
        out["error"] = None
    except MeshError as e:
        out["error"] = str(e)
    return out


def test_groups_on_four_ranks() -> None:
    results = run_world(4, _layouts, timeout=90)
    for rank, r in enumerate(results):
        # dp=2, tp=2: tp pairs are neighbours, dp pairs are 2 apart
        tp_pair = [rank - rank % 2, rank - rank % 2 + 1]
        dp_pair = [rank % 2, rank % 2 + 2]
        assert r["212"]["tp"] == (tp_pair, sum(tp_pair))
        assert r["212"]["dp"] == (dp_pair, sum(dp_pair))
        assert r["212"]["pp"] == ([rank], rank)
        assert r["122"]["pp"][0] == dp_pair and r["122"]["dp"][0] == [rank]
        assert r["411"]["dp"] == ([0, 1, 2, 3], 6) and r["114"]["tp"] == ([0, 1, 2, 3], 6)
        assert r["error"] == "dp(2) * pp(2) * tp(2) = 8 != world size 4"

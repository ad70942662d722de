"""plait.Mesh in a world of four ranks: each axis's group."""

from __future__ import annotations

from typing import Any

import torch

from plait import Communicator, Mesh
from plait.comm.mesh import MeshError
from support.world import run_world


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

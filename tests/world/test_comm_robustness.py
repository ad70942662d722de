"""Collectives on parameters that require grad, and a rank that raises half-way through a
collective: its peers must hear of it at once, not after PLAIT_TIMEOUT."""

import time

import pytest
import torch

import plait
from support.world import run_world


def _params_then_a_local_error(comm):
    out = {}
    for algo in ("tree", "ring", "halving_doubling", "native"):
        p = torch.nn.Parameter(torch.full((5,), float(comm.rank + 1)))
        comm.allreduce_(p, algorithm=algo)  # in place on a leaf that requires grad
        got = comm.allreduce(p, algorithm=algo)
        out[algo] = (p.detach().tolist(), got.grad_fn is None, got.requires_grad)

    if comm.rank == 0:  # rank 0's algorithm breaks after the call started everywhere
        import dataclasses

        from plait.comm.dispatch import routes

        def broken(ctx, buf, op):
            raise RuntimeError("disk full")

        row = routes.ROUTES["allreduce", "tree"]  # the routing table's row for the call
        routes.ROUTES["allreduce", "tree"] = dataclasses.replace(row, run=broken)
    start = time.monotonic()
    try:
        comm.allreduce(torch.ones(4), algorithm="tree")
    except plait.PeerFailureError as e:
        out["error"] = ("PeerFailureError", e.rank, "disk full" in str(e))
    except RuntimeError as e:
        out["error"] = ("RuntimeError", None, "disk full" in str(e))
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.timeout(90)
def test_parameters_and_a_rank_raising_mid_collective():
    # a long PLAIT_TIMEOUT: only the abort can make rank 1 return quickly
    rank0, rank1 = run_world(2, _params_then_a_local_error, env={"PLAIT_TIMEOUT": "600"})
    for result in (rank0, rank1):
        for algo in ("tree", "ring", "halving_doubling", "native"):
            assert result[algo] == ([3.0] * 5, True, False), algo
    assert rank0["error"] == ("RuntimeError", None, True)
    assert rank1["error"] == ("PeerFailureError", 0, True)
    assert rank1["seconds"] < 5

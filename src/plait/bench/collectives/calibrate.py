"""`plait bench collectives --calibrate`: each flat allreduce row's cost line, and the two
levels of the hierarchical one, measured on this world and saved for `algorithm="auto"`.

Which rows are flat, and their order, come from the routing table and the cost model
(the routing table's flat rows, which auto weighs as one level), so a new algorithm is
calibrated without a line here.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from plait.bench.collectives.allreduces import measure
from plait.comm.dispatch import calibration, routes
from plait.sizes import parse_sizes

CALIBRATION_SIZES = "4K,64K,512K,2M,8M,32M,64M"


def flat_rows() -> list[str]:
    """The allreduce rows the cost model weighs as one level (the table's flat rows), in the
    routing table's order: native (torch.distributed's, under plait's watchdog) and plait's
    own."""
    return list(routes.flat("allreduce"))


def calibrate(comm: Any, repeats: int, budget_s: float, device: torch.device) -> dict[str, Any]:
    """Fit and save every flat row's line for this world (and its levels across hosts);
    return what the report shows: {"calibration": {row: {alpha, beta}}, "levels": ...}."""
    fit = flat_rows()
    sizes = parse_sizes(CALIBRATION_SIZES)
    data = measure(comm, sizes, fit, repeats, budget_s, device=device)
    points = {a: [[int(s), statistics.median(data[s][a])] for s in data] for a in fit}
    if comm.rank == 0:
        calibration.save_calibration(
            comm.size, comm.num_nodes, "allreduce", points, device=device.type
        )
    comm.barrier()
    calibration.load_calibration(reload=True)
    out: dict[str, Any] = {}
    if comm.topology.levels is not None:
        out["levels"] = calibrate_levels(comm, sizes, repeats, budget_s)
    # one global line per algorithm, for the report: its alpha (s) and beta (s/byte)
    out["calibration"] = {
        a: dict(zip(("alpha", "beta"), fit_line([(int(n), t) for n, t in p]), strict=True))
        for a, p in points.items()
    }
    return out


def calibrate_levels(
    comm: Any, sizes: list[int], repeats: int, budget_s: float
) -> dict[str, list[float]]:
    """The two levels of the hierarchical allreduce, measured apart and saved for `auto`.

    local: an allreduce among one host's ranks (shared memory), at n bytes; network: the
    best flat allreduce of plait's among the ranks of one local rank on every host, at n / L
    bytes, with all L such groups running at once, as they do inside the hierarchical
    allreduce (they share each host's link). Returns and saves each level's fitted alpha
    and beta.
    """
    local_ranks, _ = comm.topology.levels
    host = comm.split(color=comm.node_rank, key=comm.rank)
    cross = comm.split(color=local_ranks.index(comm.rank), key=comm.rank)
    per_local = len(local_ranks)
    local = measure(host, sizes, ["auto"], repeats, budget_s / 2, world=comm)
    flat = [a for a in flat_rows() if a != "native"]  # the cross level runs plait's own
    parts = [max(4, n // per_local // 4 * 4) for n in sizes]  # whole float32s
    network = measure(cross, parts, flat, repeats, budget_s / 2, world=comm)
    levels = {
        "local": fit_line([(int(n), statistics.median(c["auto"])) for n, c in local.items()]),
        "network": fit_line([
            (n, min(statistics.median(ts) for ts in c.values()))
            for n, c in zip(sizes, network.values(), strict=True)
        ]),
    }  # fmt: skip
    if comm.rank == 0:
        calibration.save_levels(comm.size, comm.num_nodes, levels)
    comm.barrier()
    return {k: list(v) for k, v in levels.items()}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares t = A + B n, weighted by 1/t so small and large sizes count alike."""
    w = [1.0 / t for _, t in points]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * n for wi, (n, _) in zip(w, points, strict=True))
    sy = sum(wi * wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * wi * n * n for wi, (n, _) in zip(w, points, strict=True))
    sxy = sum(wi * wi * n * t for wi, (n, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    return max(a, 0.0), max(b, 0.0)

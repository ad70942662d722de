"""Gradient compression in DataParallel (data_parallel/compression.py) against references.

One world of 3 ranks runs every in-process case once (`battery`). Each rank feeds
DataParallel gradients it chooses (`Chosen`: backward leaves x as the parameter's gradient),
drawn from seeds every process knows, and returns what it got: the averaged gradients,
its compressor's residuals, the bytes it sent, the collectives it issued. The parent then
simulates every rank of each algorithm in one process (the reference) and compares:
fp16/bf16 within the dtype's rounding of the true average, top-k bit for bit (residuals
too), PowerSGD to float64 rounding (its orthogonalisation here is torch's QR, not the code's
Gram-Schmidt). Bytes are checked against each method's payload formula, written from the
papers' definitions. The compressors alone are in tests/unit/test_compressors.py; training
with each method in tests/world/test_train_loop.py, and the command line's one
`plait train --compression` run in tests/e2e/test_train_loop_command.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator
from plait.data_parallel import DataParallel
from plait.data_parallel.compression import PowerSGD, TopK
from support.compression_reference import orth
from support.world import run_world

WORLD = 3
ENV = {"PLAIT_TIMEOUT": "60"}
F64 = 8  # bytes of a float64 value
TOPK_SHAPES = [(30, 20), (45,), (7, 3, 2)]
# (32, 24) and (6, 5, 4) -> (6, 20) are compressed at rank 2; (4, 4) and (10,) are too small
PSGD_SHAPES = [(32, 24), (6, 5, 4), (4, 4), (10,)]


class Chosen(nn.Module):
    """sum_j (w_j * x_j).sum(): backward leaves x_j as w_j's gradient (None: w_j unused)."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes)

    def forward(self, xs: list[torch.Tensor | None]) -> torch.Tensor:
        return sum((w * x).sum() for w, x in zip(self.ws, xs, strict=True) if x is not None)


def gradient(rank: int, step: int, shapes: list[tuple[int, ...]], dtype=torch.float64):
    """Rank `rank`'s chosen gradients at `step` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def run_steps(comm: Communicator, dp: DataParallel, shapes, steps: int, dtype=torch.float64):
    """`steps` backwards of chosen gradients: per step the averaged gradients, the bytes
    sent and the collectives issued by the backward."""
    out = []
    for step in range(steps):
        dp.zero_grad(set_to_none=True)
        loss = dp(gradient(comm.rank, step, shapes, dtype))
        before = comm.issued
        loss.backward()
        grads = [w.grad.clone() for w in dp.module.ws]
        state = dp.compression
        kept_state = {}
        if isinstance(state, TopK):
            kept_state = {i: r.clone() for i, r in state.residuals.items()}
        elif isinstance(state, PowerSGD):
            kept_state = {i: [e.clone() for e in s.errors] for i, s in state.layouts.items()}
        out.append((grads, dp.sent_bytes, comm.issued - before, kept_state))
    return out


def cast_case(comm: Communicator) -> dict[str, Any]:
    shapes = [(40, 30), (50,)]
    found: dict[str, Any] = {}
    for name, big in (("bf16", 0.0), ("fp16", 6e4)):
        dp = DataParallel(Chosen(shapes, torch.float32), comm, compression=name)
        xs = [g + big for g in gradient(comm.rank, 0, shapes, torch.float32)]
        before = comm.issued
        dp(xs).backward()
        found[name] = ([w.grad for w in dp.module.ws], dp.sent_bytes, comm.issued - before)
    # --reduce-dtype's old path and --compression bf16: the same arithmetic, bit for bit
    alias = DataParallel(Chosen(shapes, torch.float32), comm, reduce_dtype=torch.bfloat16)
    alias(gradient(comm.rank, 0, shapes, torch.float32)).backward()
    found["alias"] = [w.grad for w in alias.module.ws]
    return found


def unused_case(comm: Communicator) -> dict[str, Any]:
    """find_unused_parameters: w1 only rank 0 uses, w2 nobody (its flags cross the wire)."""
    shapes = [(32, 24), (10,), (5,)]
    found = {}
    for name in ("topk:1", "powersgd:2"):
        dp = DataParallel(Chosen(shapes, torch.float64), comm, compression=name,
                          find_unused_parameters=True)  # fmt: skip
        g = gradient(comm.rank, 0, shapes)
        dp([g[0], g[1] if comm.rank == 0 else None, None]).backward()
        found[name] = [w.grad for w in dp.module.ws]
    return found


def battery(comm: Communicator) -> dict[str, Any]:
    def topk(bucket_mb: float) -> list[Any]:
        dp = DataParallel(Chosen(TOPK_SHAPES, torch.float64), comm, bucket_mb=bucket_mb,
                          compression="topk:0.1")  # fmt: skip
        return run_steps(comm, dp, TOPK_SHAPES, 4)

    def psgd(compressor: PowerSGD, steps: int) -> list[Any]:
        dp = DataParallel(Chosen(PSGD_SHAPES, torch.float64), comm, compression=compressor)
        return run_steps(comm, dp, PSGD_SHAPES, steps)

    return {
        "cast": cast_case(comm),
        "topk one bucket": topk(25),
        "topk per tensor": topk(1e-6),  # every parameter over the cap: a bucket each
        "powersgd": psgd(PowerSGD(2, start_iter=2), 5),
        "powersgd cold": psgd(PowerSGD(1, warm_start=False, error_feedback=False), 3),
        "unused": unused_case(comm),
    }


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(WORLD, battery, timeout=240, env=ENV)


# -------------------------------------------------------------------- references
def average(step: int, shapes, dtype=torch.float64) -> list[torch.Tensor]:
    ranks = [gradient(r, step, shapes, dtype) for r in range(WORLD)]
    return [sum(gs[j] for gs in ranks) / WORLD for j in range(len(shapes))]


def topk_reference(groups: list[list[int]], steps: int):
    """Every rank's top-k with error feedback, simulated: per step the average (per
    parameter) and each rank's residual per bucket (flat, in the bucket's layout)."""
    residual: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for step in range(steps):
        grads = [gradient(r, step, TOPK_SHAPES) for r in range(WORLD)]
        result: list[torch.Tensor] = [torch.empty(0)] * len(TOPK_SHAPES)
        residuals = []
        for b, group in enumerate(groups):
            n = sum(math.prod(TOPK_SHAPES[j]) for j in group)
            k = -(-n // 10)  # ceil(0.1 n), in integers
            total = torch.zeros(n, dtype=torch.float64)
            mine = []
            for r in range(WORLD):
                acc = torch.cat([grads[r][j].reshape(-1) for j in group])
                if (b, r) in residual:
                    acc = residual[(b, r)] + acc
                chosen = acc.abs().argsort(descending=True)[:k]
                total[chosen] += acc[chosen]
                acc[chosen] = 0
                residual[(b, r)] = acc
                mine.append(acc.clone())
            total /= WORLD
            pieces = total.split([math.prod(TOPK_SHAPES[j]) for j in group])
            for j, piece in zip(group, pieces, strict=True):
                result[j] = piece.view(TOPK_SHAPES[j])
            residuals.append(mine)
        out.append((result, residuals))
    return out


@pytest.mark.timeout(300)
def test_topk_matches_every_rank_simulated_bit_for_bit(world: list[dict[str, Any]]) -> None:
    # the buckets: parameters in reverse registration order (one), or one each
    for case, groups in (("topk one bucket", [[2, 1, 0]]), ("topk per tensor", [[2], [1], [0]])):
        ref = topk_reference(groups, 4)
        for rank, got in enumerate(world):
            for step, (grads, sent, collectives, residuals) in enumerate(got[case]):
                want, want_residuals = ref[step]
                where = f"{case}, rank {rank}, step {step}"
                assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True)), where
                assert all(
                    torch.equal(residuals[b], want_residuals[b][rank]) for b in range(len(groups))
                ), where
                # one allgather per bucket; k float64 values and k int32 indices each
                sizes = [sum(math.prod(TOPK_SHAPES[j]) for j in g) for g in groups]
                assert collectives == len(groups), where
                assert sent == sum(-(-n // 10) * (F64 + 4) for n in sizes), where
    # it compressed: not the dense average
    dense = average(0, TOPK_SHAPES)
    assert not torch.equal(world[0]["topk one bucket"][0][0][0], dense[0])


def powersgd_reference(rank: int, steps: int, start: int, warm: bool, feedback: bool):
    """PowerSGD over every rank, simulated: per step the average and rank 0's errors."""
    matrices = [1, 0]  # compressed, in the bucket's order: reverse registration
    rows_cols = {j: (PSGD_SHAPES[j][0], math.prod(PSGD_SHAPES[j][1:])) for j in matrices}
    generator = torch.Generator().manual_seed(0)
    errors = {(j, r): torch.zeros(rows_cols[j], dtype=torch.float64) for j in matrices
              for r in range(WORLD)}  # fmt: skip
    qs: dict[int, torch.Tensor] = {}
    out = []
    for step in range(steps):
        result = average(step, PSGD_SHAPES)  # the plain ones' (and, before start, all)
        if step >= start:
            grads = [gradient(r, step, PSGD_SHAPES) for r in range(WORLD)]
            for j in matrices:
                ms = [grads[r][j].reshape(rows_cols[j]) for r in range(WORLD)]
                if feedback:
                    ms = [m + errors[(j, r)] for r, m in enumerate(ms)]
                if j not in qs or not warm:
                    qs[j] = torch.randn(rows_cols[j][1], rank, generator=generator,
                                        dtype=torch.float64)  # fmt: skip
                q = orth(qs[j])
                p = orth(sum(m @ q for m in ms))
                qs[j] = sum(m.T @ p for m in ms) / WORLD
                approx = p @ qs[j].T
                for r, m in enumerate(ms):
                    errors[(j, r)] = m - approx
                result[j] = approx.view(PSGD_SHAPES[j])
        out.append((result, [errors[(j, 0)] for j in matrices]))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "rank", "steps", "start", "warm", "feedback"),
    [("powersgd", 2, 5, 2, True, True), ("powersgd cold", 1, 3, 0, False, False)],
)
def test_powersgd_matches_every_rank_simulated(
    world: list[dict[str, Any]], case: str, rank: int, steps: int, start: int, warm: bool,
    feedback: bool,
) -> None:  # fmt: skip
    ref = powersgd_reference(rank, steps, start, warm, feedback)
    dense = sum(math.prod(s) for s in PSGD_SHAPES) * F64
    # P: (32 + 6) x r, with the plain ones (16 + 10); Q: (24 + 20) x r
    compressed = ((32 + 6) * rank + 16 + 10) * F64 + (24 + 20) * rank * F64
    for r, got in enumerate(world):
        for step, (grads, sent, collectives, errors) in enumerate(got[case]):
            want, want_errors = ref[step]
            where = f"{case}, rank {r}, step {step}"
            for a, b in zip(grads, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=where)
            if step < start:  # plain allreduce: one, dense
                assert (sent, collectives) == (dense, 1), where
                continue
            assert (sent, collectives) == (compressed, 2), where  # P, then Q
            assert not torch.allclose(grads[0], average(step, PSGD_SHAPES)[0]), where
            if feedback and r == 0:
                for a, b in zip(errors[0], want_errors, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=where)
            if not feedback:
                assert errors == {0: []}, where


@pytest.mark.timeout(300)
def test_fp16_bf16_average_within_the_rounding(world: list[dict[str, Any]]) -> None:
    shapes = [(40, 30), (50,)]
    exact = average(0, shapes, torch.float32)
    terms = [gradient(r, 0, shapes, torch.float32) for r in range(WORLD)]
    for name, u, big in (("bf16", 2.0**-8, 0.0), ("fp16", 2.0**-11, 6e4)):
        for got in world:
            grads, sent, collectives = got["cast"][name]
            assert (sent, collectives) == ((40 * 30 + 50) * 2, 1), name  # 2-byte values
            for j, g in enumerate(grads):
                assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
                # p terms rounded, p - 1 partial sums rounded: each by u at most
                bound = 2 * WORLD * u * sum((t[j] + big).abs() for t in terms) / WORLD
                assert ((g - (exact[j] + big)).abs() <= bound).all(), name
                assert not torch.equal(g, exact[j] + big), name  # the rounding is there
            assert all(
                torch.equal(a, b)
                for a, b in zip(got["cast"]["alias"], got["cast"]["bf16"][0], strict=True)
            )


@pytest.mark.timeout(300)
def test_unused_parameters_cross_the_wire_as_flags(world: list[dict[str, Any]]) -> None:
    shapes = [(32, 24), (10,), (5,)]
    only_rank0 = gradient(0, 0, shapes)[1] / WORLD  # averaged with zeros where unused
    for got in world:
        topk, psgd = got["unused"]["topk:1"], got["unused"]["powersgd:2"]
        torch.testing.assert_close(topk[0], average(0, shapes)[0], rtol=0, atol=1e-12)
        for grads in (topk, psgd):
            torch.testing.assert_close(grads[1], only_rank0, rtol=0, atol=1e-12)
            assert grads[2] is None  # no rank used it: left alone, as DDP does


# ------------------------------------------------------------------ without a world


# ------------------------------------------------------------------ the real command

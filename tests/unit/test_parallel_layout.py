"""A per-layer plan's layouts and conversions (plait.parallel.layout.resolve), without processes.

resolve's structure: one conversion per layout change and none elsewhere, follow layers,
the last conversion into batch; and every conversion of the table exact: its backward the
adjoint of its forward, shown on a one-process model of the collectives over W ranks'
tensors (support/layout_reps.py says what exact means for each layout).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from plait.parallel.apply import Placeholder
from plait.parallel.layout import (
    BATCH,
    BLOCK,
    CONVERSIONS,
    ELEMENTWISE,
    FEATURES,
    FULL,
    FULL_SUM,
    LINEAR,
    PARAMS,
    PARTIAL,
    PER_SAMPLE,
    LayerKind,
    LayerPlan,
    Op,
    choices,
    conversion,
    data_parallel,
    on,
    resolve,
)
from support.layout_reps import LAYOUTS, gradient_of, gradient_parts, value_of, value_parts

Parts = list[torch.Tensor]


# ------------------------------------------------------ the collectives, in one process
def _chunk(t: torch.Tensor, dim: str, w: int, r: int) -> torch.Tensor:
    return t.chunk(w, 0 if dim == "rows" else -1)[r]


def _cat(parts: Parts, dim: str) -> torch.Tensor:
    return torch.cat(parts, 0 if dim == "rows" else -1)


def _other(dim: str) -> str:
    return "cols" if dim == "rows" else "rows"


def _simulate(op: Op, ts: Parts, like: Parts | None) -> Parts:
    """What each of the W ranks holds after `op` on `ts` (each rank's tensor); `like`:
    each rank's input shape, where backward's pad needs it."""
    w, empty = len(ts), ts[0].new_empty(0)
    ranks, mine = range(w), op.root
    k = op.kind
    if k == "allgather":
        return [_cat(ts, op.dim)] * w
    if k == "reduce_scatter":
        return [_chunk(sum(ts[1:], ts[0]), op.dim, w, r) for r in ranks]
    if k == "alltoall":  # gathers op.dim, splits the other
        return [_cat([_chunk(t, _other(op.dim), w, r) for t in ts], op.dim) for r in ranks]
    if k == "allreduce":
        return [sum(ts[1:], ts[0])] * w
    if k == "gather":
        return [_cat(ts, op.dim) if r == mine else empty for r in ranks]
    if k == "scatter":
        return [_chunk(ts[mine], op.dim, w, r) for r in ranks]
    if k == "broadcast":
        return [ts[mine]] * w
    if k == "reduce":
        return [sum(ts[1:], ts[0]) if r == mine else empty for r in ranks]
    if k == "send":
        return [ts[op.src] if r == mine else empty if r == op.src else ts[r] for r in ranks]
    if k == "slice":
        return [_chunk(ts[r], op.dim, w, r) for r in ranks]
    if k == "keep":
        return [t if mine < 0 or r == mine else empty for r, t in enumerate(ts)]
    assert k == "pad" and like is not None
    if not op.dim:
        return [t if r == mine else torch.zeros_like(like[r]) for r, t in enumerate(ts)]
    out = [torch.zeros_like(x) for x in like]
    for r in ranks:
        _chunk(out[r], op.dim, w, r).copy_(ts[r])
    return out


def _run(ops: tuple[Op, ...], ts: Parts, like: Parts | None = None) -> Parts:
    for op in ops:
        ts = _simulate(op, ts, like)
    return ts


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def _every_pair(w: int) -> list[tuple[str, str]]:
    ranks = [on(r) for r in range(w)]
    pairs = [(s, d) for s in (*LAYOUTS, *ranks) for d in (BATCH, FEATURES, FULL, FULL_SUM, *ranks)]
    return [(s, d) for s, d in pairs if s != d and not (s in ranks and d == PARTIAL)]


@pytest.mark.parametrize("w", [2, 3])
def test_every_conversion_backward_is_its_forward_adjoint(w: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * w, 3, 2 * w, dtype=torch.float64, generator=gen)  # (rows, ., cols)
    g = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    pairs = _every_pair(w)
    assert {p for p in pairs if "rank" not in p[0] + p[1]} == set(CONVERSIONS)
    for src, dst in pairs:
        fwd, bwd = conversion(src, dst)
        parts = value_parts(src, x, w, gen)
        out = _run(fwd, parts)
        assert _diff(value_of(dst, out), x) < 1e-12, (src, dst)
        back = _run(bwd, gradient_parts(dst, g, w, gen), like=parts)
        assert [b.shape for b in back] == [p.shape for p in parts], (src, dst)
        got = gradient_of(src, back)
        assert _diff(got, g) < 1e-12, (src, dst, "backward")
        # the adjoint identity itself: sum_r <F(x)_r, g_r> == sum_r <x_r, F^T(g)_r>
        # for layouts whose pairing is <X, G> (full pairs W copies: W <X, G>)
        if FULL not in (src, dst):
            gd = gradient_parts(dst, g, w, gen)
            lhs = sum(float((a * b).sum()) for a, b in zip(out, gd, strict=True))
            back = _run(bwd, gd, parts)
            rhs = sum(float((a * b).sum()) for a, b in zip(parts, back, strict=True))
            assert lhs == pytest.approx(rhs, rel=1e-12), (src, dst)


def test_conversions_into_partial_are_refused() -> None:
    for src in (BATCH, FULL, on(1)):
        with pytest.raises(ValueError, match="no layer takes partial"):
            conversion(src, PARTIAL)


# ------------------------------------------------------------------- resolve's structure
LIN = LayerKind("Linear(24, 48)", LINEAR, 24, 48)
LIN2 = LayerKind("Linear(48, 24)", LINEAR, 48, 24)
RELU = LayerKind("ReLU", ELEMENTWISE)
FLAT = LayerKind("Flatten", PER_SAMPLE)
CONV = LayerKind("Conv2d", PARAMS)
BLK = LayerKind("Block", BLOCK, units=12)


def _check_structure(plan: LayerPlan, layers: list[LayerKind]) -> None:
    """One conversion per layout change, none elsewhere; the last into batch."""
    res = resolve(plan, layers)
    now = BATCH
    for i in range(len(layers) + 1):
        conv = res.before(i)
        assert [c.before for c in res.conversions].count(i) <= 1
        want = res.layouts[i] if i < len(layers) else BATCH
        if conv is None:
            assert want == now, (plan.choices, i)
        else:
            assert (conv.src, conv.dst) == (now, want) and now != want
            assert (conv.forward, conv.backward) == conversion(now, want)
        if i < len(layers):
            now = res.outputs[i]
    assert now == res.outputs[-1]


def test_data_parallel_plan_converts_nothing() -> None:
    for layers in ([LIN, RELU, LIN2], [CONV, RELU, FLAT, LIN], [BLK, BLK, LIN2]):
        res = resolve(data_parallel(layers, 4), layers)
        assert res.conversions == ()
        assert set(res.layouts) == set(res.outputs) == {BATCH}


def test_one_conversion_per_layout_change_and_none_elsewhere() -> None:
    layers = [LIN, RELU, LIN2, FLAT, BLK, LIN]
    options = [choices(x, 2) for x in layers]
    seen = set()
    for picked in itertools.product(*options):
        plan = LayerPlan(tuple(picked), 2)
        _check_structure(plan, layers)
        seen |= {(c.src, c.dst) for c in resolve(plan, layers).conversions}
    # a full+ tensor is only ever made for a column layer, which takes it: never converted on
    assert not any(src == FULL_SUM for src, _ in seen)
    assert {(src, dst) for src, dst in seen if "rank" not in src + dst} == {
        p for p in CONVERSIONS if p[0] != FULL_SUM
    }


def test_follow_layers_run_where_their_input_is() -> None:
    layers = [LIN, RELU, LIN2, FLAT, LIN, RELU, LIN2]
    res = resolve(LayerPlan(("column", "follow", "row", "follow", "rank:1", "follow", "data"),
                            2), layers)  # fmt: skip
    # ReLU runs in features (elementwise); Flatten cannot take a partial sum: it is summed
    # into what the next layer with parameters takes (rank 1), and runs there
    assert res.layouts == (FULL_SUM, FEATURES, FEATURES, on(1), on(1), on(1), BATCH)
    assert [(c.before, c.src, c.dst) for c in res.conversions] == [
        (0, BATCH, FULL_SUM), (3, PARTIAL, on(1)), (6, on(1), BATCH)]  # fmt: skip
    # a per-sample layer in features is converted to batch when the next layer takes features
    res = resolve(LayerPlan(("column", "follow", "row"), 2), [LIN, FLAT, LIN2])
    assert res.layouts[1] == BATCH
    assert [(c.src, c.dst) for c in res.conversions] == [
        (BATCH, FULL_SUM), (FEATURES, BATCH), (BATCH, FEATURES), (PARTIAL, BATCH)]  # fmt: skip


def test_the_output_is_converted_to_batch() -> None:
    for last in ("column", "row", "rank:0"):
        res = resolve(LayerPlan(("data", last), 2), [LIN, LIN2])
        conv = res.conversions[-1]
        assert (conv.before, conv.dst) == (2, BATCH)
    res = resolve(LayerPlan(("split", "split"), 4), [BLK, BLK])
    assert [(c.src, c.dst) for c in res.conversions] == [(BATCH, FULL), (FULL, BATCH)]


def test_a_placeholder_works_out_a_shape_once_per_input_shape() -> None:
    # the meta forward (Python meta kernels) runs once per input shape, not every step
    calls = []
    layer = nn.Linear(4, 3)
    layer.register_forward_hook(lambda *_: calls.append(1))
    held = Placeholder(layer, holder=1)
    x = torch.empty(0, requires_grad=True)
    for rows in (5, 5, 7):
        y, whole = held(x, torch.empty(rows, 4, device="meta"))
        assert whole.shape == (rows, 3) and whole.device.type == "meta" and y.requires_grad
    assert len(calls) == 2

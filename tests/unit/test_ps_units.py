"""plait.ps in one process: the wire decoder (fuzzed), the sharding plan, the slice
optimizers against torch.optim, and the consistency rules."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from plait.errors import PlaitError
from plait.ps.config import PSConfig
from plait.ps.consistency import DEAD, Consistency
from plait.ps.optim import make_optimizer
from plait.ps.sharding import ParamSpec, gather, make_plan, scatter
from plait.ps.wire import MAX_HEADER_BYTES, Message, WireError, decode, encode

# -- wire -------------------------------------------------------------------------------------


def _sample() -> list[bytes]:
    msg = Message(
        "push",
        7,
        1,
        [0, 3],
        [torch.arange(6, dtype=torch.float32), torch.ones(2, dtype=torch.float64)],
        [2, 2],
        0.05,
        4,
        {"note": "x"},
    )
    return [bytes(p) for p in encode(msg)]


def test_wire_round_trip() -> None:
    m = decode(_sample())
    assert (m.op, m.rid, m.worker, m.keys, m.versions, m.lr, m.clock) == (
        "push",
        7,
        1,
        [0, 3],
        [2, 2],
        0.05,
        4,
    )
    torch.testing.assert_close(m.tensors[0], torch.arange(6, dtype=torch.float32))
    assert m.tensors[1].dtype == torch.float64
    bf = decode([bytes(p) for p in encode(Message("ok", 1, -1, [5], [torch.ones(3).bfloat16()]))])
    assert bf.tensors[0].dtype == torch.bfloat16


def _mutations(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    kind = rng.randrange(7)
    i = rng.randrange(len(frames))
    if kind == 0:  # random bytes
        frames[i] = rng.randbytes(rng.randrange(64))
    elif kind == 1:  # truncation
        frames[i] = frames[i][: rng.randrange(max(1, len(frames[i])))]
    elif kind == 2:  # bit flips
        b = bytearray(frames[i])
        for _ in range(rng.randrange(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    elif kind == 3:  # wrong frame count
        frames = frames[:-1] if rng.random() < 0.5 else [*frames, rng.randbytes(8)]
    elif kind == 4:  # extra bytes in a tensor frame
        frames[-1] = frames[-1] + b"\0" * rng.randrange(1, 9)
    elif kind == 5:  # a header that is valid msgpack but breaks the schema
        h = msgpack.unpackb(frames[0])
        field = rng.choice(list(h))
        h[field] = rng.choice([None, -1, 2**64 - 1, "x", [1.5], {"a": 1}, [[-3]], 1e308, True])
        frames[0] = msgpack.packb(h)
    else:  # an unknown field or op
        h = msgpack.unpackb(frames[0])
        h[rng.choice(["op", "evil"])] = "__import__"
        frames[0] = msgpack.packb(h)
    return frames


def test_wire_fuzz_only_wire_errors() -> None:
    rng = random.Random(0)
    good = _sample()
    rejected = 0
    for _ in range(4000):
        frames = _mutations(rng, good)
        try:
            decode(frames)
        except WireError as e:
            assert e.reason
            rejected += 1
    assert rejected > 3000  # most mutations are caught (some flips land in tensor payloads)


def test_wire_errors_are_plait_errors() -> None:
    with pytest.raises(PlaitError, match=r"malformed message: expected 1 to \d+ frames; got 0"):
        decode([])


def test_wire_limits() -> None:
    with pytest.raises(WireError, match="header is"):
        decode([b"\x80" + b"\0" * MAX_HEADER_BYTES])
    with pytest.raises(WireError, match="frames"):
        decode([])
    with pytest.raises(WireError, match="frames"):
        decode([b"\x80"] * 20000)
    h = msgpack.unpackb(_sample()[0])
    h["shapes"] = [[2**40, 2**40], [2]]
    with pytest.raises(WireError):
        decode([msgpack.packb(h), b"", b"\0" * 16])
    h = msgpack.unpackb(_sample()[0])
    h["dtypes"] = ["object", "float64"]
    with pytest.raises(WireError, match="dtype"):
        decode([msgpack.packb(h), *_sample()[1:]])
    ext = msgpack.packb({"v": 1, "op": "hb", "meta": {"x": msgpack.ExtType(1, b"ab")}})
    with pytest.raises(WireError):
        decode([ext])


# -- sharding ---------------------------------------------------------------------------------


def test_plan_spreads_a_large_tensor_and_packs_small_ones() -> None:
    specs = [ParamSpec("big", (1000, 100), torch.float32)] + [
        ParamSpec(f"b{i}", (10,), torch.float32) for i in range(20)
    ]
    slice_bytes = 40_000
    plan = make_plan(specs, 3, slice_bytes)
    assert all(k.nbytes <= slice_bytes for k in plan.keys)
    big_servers = {k.server for k in plan.keys if k.segments[0].param == 0}
    assert big_servers == {0, 1, 2}
    packs = [k for k in plan.keys if len(k.segments) > 1]
    assert len(packs) == 1 and len(packs[0].segments) == 20
    per = plan.bytes_per_server
    assert sum(per) == sum(s.numel * 4 for s in specs)
    assert max(per) - min(per) <= slice_bytes
    # every element is covered exactly once, and gather/scatter round-trip
    tensors = [torch.randn(s.shape) for s in specs]
    out = [torch.zeros(s.shape) for s in specs]
    for k in plan.keys:
        scatter(k, gather(plan, k, tensors), out)
    for a, b in zip(tensors, out, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seed", range(5))
def test_plan_balance_random(seed: int) -> None:
    rng = random.Random(seed)
    specs = [
        ParamSpec(f"p{i}", (rng.randrange(1, 3000),), rng.choice([torch.float32, torch.float64]))
        for i in range(40)
    ]
    slice_bytes = 4096
    plan = make_plan(specs, rng.randrange(1, 5), slice_bytes)
    per = plan.bytes_per_server
    assert max(per) - min(per) <= slice_bytes
    assert all(k.nbytes <= slice_bytes and len({k.dtype}) == 1 for k in plan.keys)
    assert [k.key for k in plan.keys] == list(range(len(plan.keys)))


# -- optimizers -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize(
    "cfg",
    [
        PSConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
        PSConfig(optimizer="sgd", lr=0.1, momentum=0.0),
        PSConfig(optimizer="adam", lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
    ],
)
def test_slice_optimizers_match_torch(cfg: PSConfig, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(50, generator=g, dtype=dtype)
    ref = torch.nn.Parameter(p.clone())
    if cfg.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            [ref], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    else:
        opt = torch.optim.Adam(
            [ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    slices = [(0, 20), (20, 50)]  # one parameter cut in two keys
    opts = [make_optimizer(cfg) for _ in slices]
    values = [p[a:b].clone() for a, b in slices]
    for _ in range(10):
        grad = torch.randn(50, generator=g, dtype=dtype)
        ref.grad = grad.clone()
        opt.step()
        values = [
            o.step(v, grad[a:b], cfg.lr) for o, v, (a, b) in zip(opts, values, slices, strict=True)
        ]
    torch.testing.assert_close(torch.cat(values), ref.detach(), rtol=tol, atol=tol)


# -- consistency ------------------------------------------------------------------------------


def test_ssp_gate_and_dead_workers() -> None:
    c = Consistency(PSConfig(mode="ssp", staleness=2, worker_timeout_s=1.0), 3, [0], now=0.0)
    for w in range(3):
        c.heard(w, 0.0, 0)
    c.heard(0, 0.1, 3)  # worker 0 at clock 3, the others at 0
    assert not c.pull_ready(0)
    c.heard(1, 0.1, 1)
    c.heard(2, 0.1, 1)
    assert c.pull_ready(0)  # 3 - 1 <= 2
    c.heard(0, 2.0, 4)  # 4 - 1 > 2 until the slow ones catch up, or die
    c.heard(1, 2.0, 2)
    assert not c.pull_ready(0)
    assert c.check_liveness(2.0) == [2] and c.status[2] == DEAD
    assert c.pull_ready(0)  # 4 - 2 <= 2: the dead worker no longer counts
    assert c.sync_failure() is None


def test_sync_round_and_failure() -> None:
    c = Consistency(PSConfig(mode="sync", worker_timeout_s=1.0), 2, [0], now=0.0)
    for w in range(2):
        c.heard(w, 0.0, 0)
    d = c.decide(0, 1, {0: 0}, 0.1)
    assert d.action == "round"
    c.join_round(0, {0: torch.ones(2)}, 0.1)
    assert not c.round_ready() and not c.pull_ready(0) and c.pull_ready(1)
    c.join_round(1, {0: 3 * torch.ones(2)}, 0.2)
    assert c.round_ready()
    mean, lr, n = c.take_round()
    torch.testing.assert_close(mean[0], 2 * torch.ones(2))
    assert (lr, n) == (0.1, 2) and c.pull_ready(0)
    c.heard(0, 5.0, 1)
    assert c.check_liveness(5.0) == [1] and c.sync_failure() == 1


def test_stale_policies_and_warm_start() -> None:
    drop = Consistency(PSConfig(mode="async", stale_policy="drop", drop_bound=1), 2, [0], 0.0)
    drop.version[0] = 5
    assert drop.decide(0, 1, {0: 4}, 0.1).action == "apply"
    assert drop.decide(0, 2, {0: 3}, 0.1).action == "drop"
    assert drop.stats.dropped_gradients == 1 and drop.stats.applied_gradients == 1
    scale = Consistency(PSConfig(mode="async", stale_policy="scale"), 2, [0], 0.0)
    scale.version[0] = 4
    d = scale.decide(0, 1, {0: 0}, 0.1)
    assert d.action == "apply" and d.lr == pytest.approx(0.025) and d.staleness == 4
    assert scale.decide(0, 2, {0: 4}, 0.1).lr == pytest.approx(0.1)
    warm = Consistency(PSConfig(mode="async", warm_start_steps=2), 2, [0], 0.0)
    assert warm.decide(0, 1, {}, 0.1).action == "round"
    assert warm.decide(0, 2, {}, 0.1).action == "round"
    assert warm.decide(0, 3, {}, 0.1).action == "apply"
    # a restarted server's versions may be behind what a worker pulled: staleness 0, not < 0
    assert warm.staleness({0: 10}) == 0


def test_config_validation_shows_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'bsp'"):
        PSConfig(mode="bsp")
    with pytest.raises(ValueError, match="drop_bound=None"):
        PSConfig(stale_policy="drop")
    with pytest.raises(ValueError, match="-1"):
        PSConfig(staleness=-1)
    cfg = PSConfig(mode="ssp", betas=(0.5, 0.6))
    assert PSConfig.from_json(cfg.to_json()) == cfg

"""The pipeline runtime against the unsplit model: loss and every gradient, both schedules.

One world per size (2 and 4 stages) runs every (schedule, chunks, balance) combination:
each rank builds the full model from one seed, computes the full-batch reference loss and
gradients, then runs its stage through `Pipeline.step` and compares. float64, so the
tolerance is tight. The in-flight activation count (from the actions) and the saved-tensor
bytes (from autograd hooks) must match what the schedule promises.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator, Mesh
from plait.pipeline import Pipeline, build, simulate, split_sizes
from support.world import run_world

f64 = torch.float64
LAYERS = 8  # 4 x (Linear, Tanh)
BATCH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS // 2):
        layers += [nn.Linear(6 if i == 0 else 5, 5), nn.Tanh()]
    return nn.Sequential(*layers).to(f64)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _one(
    comm: Communicator,
    schedule: str,
    chunks: int,
    balance: list[int] | None,
    use_mesh: bool,
    virtual: int = 1,
) -> dict[str, Any]:
    model = _model()
    torch.manual_seed(1)
    x = torch.randn(BATCH, 6, dtype=f64)
    y = torch.randn(BATCH, 5, dtype=f64)
    ref = copy.deepcopy(model)
    ref_loss = _mse(ref(x), y)
    ref_loss.backward()
    group: Any = Mesh(pp=comm.size, comm=comm) if use_mesh else comm
    pipe = Pipeline(
        model, group, chunks=chunks, schedule=schedule, balance=balance, virtual=virtual
    )
    p, s = comm.size, comm.rank
    sizes = split_sizes(LAYERS, p * virtual, balance)
    # (layer index in the model, the pipeline's layer) of every part this rank holds
    mine = [
        (sum(sizes[: j * p + s]) + i, layer)
        for j, layers in enumerate(pipe.part_layers)
        for i, layer in enumerate(layers)
    ]
    errs: list[float] = []
    for _ in range(2):  # twice: a second step must work alike after zero_grad
        pipe.stage.zero_grad()
        loss = pipe.step(x if s == 0 else None, y if s == p - 1 else None, _mse)
        if s == p - 1:
            assert loss is not None
            errs.append(abs(float(loss) - float(ref_loss.detach())))
        else:
            assert loss is None
        for index, layer in mine:
            for (name, got), want in zip(
                layer.named_parameters(), ref[index].parameters(), strict=True
            ):
                assert got.grad is not None, f"layer {index}.{name} has no grad"
                errs.append(float((got.grad - want.grad).abs().max()))
    st = pipe.stats
    return {
        "err": max(errs, default=0.0),
        "n_layers": len(mine),
        "want_layers": sum(sizes[j * p + s] for j in range(virtual)),
        "want_peak": simulate(build(schedule, p, chunks, virtual), 1, 1, 1).peak_activations[s],
        "want_actions": len(build(schedule, p, chunks, virtual)[s]),
        "peak": st.peak_inflight,
        "saved_peak": st.peak_saved_bytes,
        "mb_saved": st.mb_saved_bytes,
        "saved_live": st.saved_live,
        "bubble": st.bubble,
        "actions": len(st.times),
        "compute": st.compute_time,
        "step": st.step_time,
    }


def _all(comm: Communicator) -> dict[str, Any]:
    import plait.comm.messaging as messaging

    lane_messages = []  # payloads sent or received over ordered lanes
    real = messaging.LaneRequest
    messaging.LaneRequest = lambda *a, **k: lane_messages.append(1) or real(*a, **k)
    p = comm.size
    out: dict[str, Any] = {}
    uneven = [1] * (p - 1) + [LAYERS - (p - 1)]
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for chunks in (1, 2, 4):
            for bal in (None, uneven):
                for use_mesh in (False, True) if chunks == 2 else (False,):
                    key = f"{schedule}/c{chunks}/{bal}/mesh={use_mesh}"
                    out[key] = _one(comm, schedule, chunks, bal, use_mesh)
    # interleaved: 2 parts per rank (8 layers: p * 2 virtual stages), chunks in groups of p
    for chunks in (p, 2 * p):
        for bal in (None, [1] * (2 * p - 1) + [LAYERS - (2 * p - 1)]):
            key = f"interleaved/c{chunks}/{bal}/mesh={chunks == p}"
            out[key] = _one(comm, "interleaved", chunks, bal, chunks == p, virtual=2)
    messaging.LaneRequest = real
    out["lane_messages"] = len(lane_messages)
    return out


@pytest.mark.parametrize(("size", "link"), [(2, None), (4, None), (4, "group")])
def test_pipeline_matches_unsplit_model(size: int, link: str | None) -> None:
    # link "group": payloads over ordered lanes (gloo's), as CUDA tensors go over NCCL's
    env = {"PLAIT_TEST_LINK": link} if link else None
    results = run_world(size, _all, timeout=60, env=env)
    for stage, res in enumerate(results):
        lane_messages = res.pop("lane_messages")
        assert (lane_messages > 0) == (link == "group"), (stage, lane_messages)
        for key, r in res.items():
            schedule = key.split("/")[0]
            chunks = int(key.split("/")[1][1:])
            assert r["err"] < 1e-10, (stage, key, r)
            assert r["n_layers"] == r["want_layers"], (stage, key, r)
            assert r["actions"] == r["want_actions"], (stage, key, r)
            assert r["peak"] == r["want_peak"], (stage, key, r)  # as the simulation counts
            if schedule == "gpipe":
                assert r["peak"] == chunks, (stage, key, r)
            elif schedule == "1f1b":
                assert r["peak"] == min(size - stage, chunks), (stage, key, r)
            elif schedule == "zb-h1":  # W held back: every stage holds stage 0's count
                assert r["peak"] == min(size, chunks), (stage, key, r)
            # saved-tensor hooks agree: equal micro-batches save equal bytes, and the peak
            # is exactly the in-flight count times one micro-batch's bytes; all freed after
            # (interleaved: a rank's parts differ, so do their bytes; zb-h1: B already frees
            # the parameter-free layers' graphs, so the peak is at most that)
            if schedule != "interleaved":
                assert len(set(r["mb_saved"])) == 1 and r["mb_saved"][0] > 0, (stage, key, r)
                most = r["peak"] * r["mb_saved"][0]
                assert r["saved_peak"] == most or (
                    schedule == "zb-h1" and 0 < r["saved_peak"] < most
                ), (stage, key, r)
            assert r["saved_live"] == 0, (stage, key, r)
            assert 0.0 <= r["bubble"] < 1.0 and r["compute"] <= r["step"]


def _fake(size: int, rank: int = 0) -> Any:
    return types.SimpleNamespace(size=size, rank=rank, connect_lanes=lambda: None)


def test_bad_balance_is_a_clear_error() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"3 \+ 3 = 6 != 8 layers"):
        Pipeline(model, _fake(2), chunks=2, balance=[3, 3])
    with pytest.raises(ValueError, match="has 3 entries but the pipeline has 2 stages"):
        Pipeline(model, _fake(2), chunks=2, balance=[2, 3, 3])
    with pytest.raises(ValueError, match="positive"):
        Pipeline(model, _fake(2), chunks=2, balance=[0, 8])
    with pytest.raises(ValueError, match="cannot split 8 layers into 9"):
        Pipeline(model, _fake(9), chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        Pipeline(model, _fake(2), chunks=2, schedule="zigzag")


def test_split_sizes_default_is_even() -> None:
    assert split_sizes(8, 3) == [3, 3, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(5, 5, [1, 1, 1, 1, 1]) == [1, 1, 1, 1, 1]


def test_batch_smaller_than_chunks() -> None:
    pipe = Pipeline(_model(), _fake(1), chunks=4)
    with pytest.raises(ValueError, match="batch size 2, fewer than chunks=4"):
        pipe.step(torch.zeros(2, 6, dtype=f64), torch.zeros(2, 5, dtype=f64), _mse)


def test_single_stage_equals_reference() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=f64), torch.randn(8, 5, dtype=f64)
    ref_loss = _mse(ref(x), y)
    ref_loss.backward()
    pipe = Pipeline(model, _fake(1), chunks=4, schedule="gpipe")
    loss = pipe.step(x, y, _mse)
    assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert float((a.grad - b.grad).abs().max()) < 1e-12


@pytest.mark.parametrize(("batch", "chunks"), [(4, 3), (10, 4), (7, 7)])
def test_uneven_micro_batches_equal_reference(batch: int, chunks: int) -> None:
    # exactly `chunks` micro-batches whatever the batch (torch.chunk gave 2 for 4 in 3)
    model = _model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(batch, 6, dtype=f64), torch.randn(batch, 5, dtype=f64)
    ref_loss = _mse(ref(x), y)
    ref_loss.backward()
    pipe = Pipeline(model, _fake(1), chunks=chunks, schedule="1f1b")
    loss = pipe.step(x, y, _mse)
    assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert float((a.grad - b.grad).abs().max()) < 1e-12


def _checkpoint_all(comm: Communicator) -> dict[str, Any]:
    """Every (schedule, checkpoint) at chunks 4: gradient error and peak saved bytes."""
    out: dict[str, Any] = {}
    p, s = comm.size, comm.rank
    torch.manual_seed(1)
    x = torch.randn(BATCH, 6, dtype=f64)
    y = torch.randn(BATCH, 5, dtype=f64)
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "except_last", "always"):
            model = _model()
            ref = copy.deepcopy(model)
            ref_loss = _mse(ref(x), y)
            ref_loss.backward()
            pipe = Pipeline(model, comm, chunks=4, schedule=schedule, checkpoint=mode)
            start = sum(pipe.balance[:s])
            loss = pipe.step(x if s == 0 else None, y if s == p - 1 else None, _mse)
            errs = [] if loss is None else [abs(float(loss) - float(ref_loss.detach()))]
            for i, layer in enumerate(pipe.stage):
                for got, want in zip(layer.parameters(), ref[start + i].parameters(), strict=True):
                    assert got.grad is not None and want.grad is not None
                    errs.append(float((got.grad - want.grad).abs().max()))
            out[f"{schedule}/{mode}"] = {
                "err": max(errs),
                "saved_peak": pipe.stats.peak_saved_bytes,
                "saved_live": pipe.stats.saved_live,
                "last_is_loss": (loss is not None) == (s == p - 1),
            }
    # balance="time": profiled on rank 0, broadcast, so both ranks agree
    pipe = Pipeline(_model(), comm, chunks=2, balance="time", sample=x[:4])
    out["time_balance"] = pipe.balance
    return out


def test_checkpoint_keeps_gradients_and_saves_memory() -> None:
    results = run_world(2, _checkpoint_all, timeout=60)
    for stage, res in enumerate(results):
        for key, r in res.items():
            if key == "time_balance":
                continue
            assert r["err"] < 1e-10, (stage, key, r)
            assert r["saved_live"] == 0 and r["last_is_loss"], (stage, key, r)
        for schedule in ("gpipe", "1f1b"):
            never = res[f"{schedule}/never"]["saved_peak"]
            always = res[f"{schedule}/always"]["saved_peak"]
            assert always <= never, (stage, schedule, always, never)
    for schedule in ("gpipe", "1f1b"):
        # stage 0 holds more than one micro-batch in flight: checkpointing must pay off there
        never = max(r[f"{schedule}/never"]["saved_peak"] for r in results)
        always = max(r[f"{schedule}/always"]["saved_peak"] for r in results)
        assert always < never, (schedule, always, never)
    balances = [r["time_balance"] for r in results]
    assert balances[0] == balances[1] and sum(balances[0]) == LAYERS, balances


def test_bad_checkpoint_and_balance_mode_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown checkpoint 'sometimes'.*'never'"):
        Pipeline(_model(), _fake(2), chunks=2, checkpoint="sometimes")
    with pytest.raises(ValueError, match=r"unknown balance 'speed'.*'size', 'time'"):
        Pipeline(_model(), _fake(2), chunks=2, balance="speed")
    with pytest.raises(ValueError, match="needs sample="):
        Pipeline(_model(), _fake(2), chunks=2, balance="time")


def test_balance_by_size_isolates_the_huge_layer() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 4)]
    model = nn.Sequential(*layers)
    # parameter bytes: 80, 0, 80, 8000, 6416 -> the two big layers get a stage each
    assert Pipeline(model, _fake(2), chunks=2, balance="size").balance == [4, 1]
    assert Pipeline(model, _fake(3), chunks=2, balance="size").balance == [3, 1, 1]
    pipe = Pipeline(model, _fake(3, rank=1), chunks=2, balance="size")
    assert len(pipe.stage) == 1 and pipe.stage[0] is layers[3]


def test_checkpoint_single_stage_equals_reference() -> None:
    for mode in ("except_last", "always"):
        model = _model()
        ref = copy.deepcopy(model)
        x, y = torch.randn(8, 6, dtype=f64), torch.randn(8, 5, dtype=f64)
        ref_loss = _mse(ref(x), y)
        ref_loss.backward()
        pipe = Pipeline(model, _fake(1), chunks=4, schedule="1f1b", checkpoint=mode)
        loss = pipe.step(x, y, _mse)
        assert loss is not None and abs(float(loss) - float(ref_loss.detach())) < 1e-12
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert float((a.grad - b.grad).abs().max()) < 1e-12

"""plait.pipeline.Pipeline across ranks against the unsplit model.

One world per size (2 and 4 stages, and 4 with payloads over ordered lanes) runs every
(schedule, chunks, balance) combination, and the 2-stage world the checkpoint modes too:
each rank builds the full model from one seed, computes the full-batch reference loss and
gradients, then runs its stage through `Pipeline.step` and compares. float64, so the
tolerance is tight. The in-flight activation count (from the actions) and the saved-tensor
bytes (from autograd hooks) must match what the schedule promises."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from plait import Communicator, Mesh
from plait.pipeline import Pipeline, build, simulate, split_sizes
from support.pipeline_model import LAYERS, f64, make_model, mse
from support.world import worlds_at_once

BATCH = 8


def _one(
    comm: Communicator,
    schedule: str,
    chunks: int,
    balance: list[int] | None,
    use_mesh: bool,
    virtual: int = 1,
) -> dict[str, Any]:
    model = make_model()
    torch.manual_seed(1)
    x = torch.randn(BATCH, 6, dtype=f64)
    y = torch.randn(BATCH, 5, dtype=f64)
    ref = copy.deepcopy(model)
    ref_loss = mse(ref(x), y)
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
        loss = pipe.step(x if s == 0 else None, y if s == p - 1 else None, mse)
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


WORLDS = {"2": (2, None), "4": (4, None), "4-group": (4, "group")}  # id: (size, link)


def _world(comm: Communicator) -> dict[str, Any]:
    """Every combination; at 2 ranks also the checkpoint modes (a world costs seconds)."""
    out = {"all": _all(comm)}
    if comm.size == 2:
        out["checkpoint"] = _checkpoint_all(comm)
    return out


World = tuple[str | None, list[dict[str, Any]]]  # the link it was run with, its ranks' results


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, Future[list[dict[str, Any]]]]]:
    """Every world of WORLDS, started at once (their ranks mostly wait for each other)."""
    # link "group": payloads over ordered lanes (gloo's), as CUDA tensors go over NCCL's
    calls = {
        key: (
            size,
            _world,
            (),
            {"timeout": 120, "env": {"PLAIT_TEST_LINK": link} if link else None},
        )
        for key, (size, link) in WORLDS.items()
    }
    with worlds_at_once(calls) as worlds:
        yield worlds


@pytest.fixture(scope="module", params=list(WORLDS))
def world(
    request: pytest.FixtureRequest, started: dict[str, Future[list[dict[str, Any]]]]
) -> World:
    """The world of one id of WORLDS, spawned once for every test that asks for it."""
    return WORLDS[request.param][1], started[request.param].result()


def test_pipeline_matches_unsplit_model(world: World) -> None:
    link, ranks = world
    size = len(ranks)
    results = [rank["all"] for rank in ranks]
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


def _checkpoint_all(comm: Communicator) -> dict[str, Any]:
    """Every (schedule, checkpoint) at chunks 4: gradient error and peak saved bytes."""
    out: dict[str, Any] = {}
    p, s = comm.size, comm.rank
    torch.manual_seed(1)
    x = torch.randn(BATCH, 6, dtype=f64)
    y = torch.randn(BATCH, 5, dtype=f64)
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "except_last", "always"):
            model = make_model()
            ref = copy.deepcopy(model)
            ref_loss = mse(ref(x), y)
            ref_loss.backward()
            pipe = Pipeline(model, comm, chunks=4, schedule=schedule, checkpoint=mode)
            start = sum(pipe.balance[:s])
            loss = pipe.step(x if s == 0 else None, y if s == p - 1 else None, mse)
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
    pipe = Pipeline(make_model(), comm, chunks=2, balance="time", sample=x[:4])
    out["time_balance"] = pipe.balance
    return out


@pytest.mark.parametrize("world", ["2"], indirect=True)
def test_checkpoint_keeps_gradients_and_saves_memory(world: World) -> None:
    results = [rank["checkpoint"] for rank in world[1]]
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

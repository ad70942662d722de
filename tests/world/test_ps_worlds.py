"""plait.ps end to end: real worker and server processes on loopback.

Each world is W workers + S servers (W + S <= 5) forked from a server that has imported
torch (tests/support/ps_world.py), so a world costs about a second, not ten. Besides the
client, the training loop of `plait train --strategy ps` runs in worlds here (`train(config,
role)` on each worker): the ssp and async modes' figures, and --priority's losses against
FIFO's; the command itself runs in tests/e2e/test_train_ps_command.py.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import zmq

import plait.ps as ps
from plait.comm.bootstrap.rendezvous import job_key, world_from_env
from plait.errors import PeerFailureError
from plait.ps.client import Client
from plait.ps.config import store_server_key
from plait.ps.wire import Message, decode, encode
from plait.train.config import TrainConfig
from plait.train.data.sampler import GlobalBatchSampler
from plait.train.evaluate import evaluate_alone
from plait.train.loop import train
from plait.train.trained import load_run
from support.ps_world import authenticate, run_ps_world

pytestmark = pytest.mark.timeout(120)
GLOBAL_BATCH, STEPS = 8, 6


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
        dtype
    )


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 6, generator=g).to(dtype), torch.randint(0, 3, (64,), generator=g)


def _sync_job(role: ps.Role, optimizer: str, dtype: torch.dtype) -> list[Any]:
    cfg = ps.PSConfig(
        mode="sync", optimizer=optimizer, lr=0.05, momentum=0.9, weight_decay=0.01, slice_mb=0.0005
    )
    x, y = _data(dtype)
    sampler = GlobalBatchSampler(len(x), GLOBAL_BATCH, seed=3)
    model = _model(dtype)
    client = ps.Client(model.named_parameters(), cfg, role)
    assert len({k.server for k in client.plan.keys}) == role.num_servers  # spread over all
    for step in range(STEPS):
        idx = sampler.shard(step, role.rank, role.num_workers)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        client.push_pull(None)
    client.close()
    return [p.detach().tolist() for p in model.parameters()]  # no tensors through a Queue


def _reference(optimizer: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """One process, the global batch, the torch optimizer: what DataParallel computes."""
    x, y = _data(dtype)
    sampler = GlobalBatchSampler(len(x), GLOBAL_BATCH, seed=3)
    ref = _model(dtype)
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.Adam(ref.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(STEPS):
        idx = sampler.indices(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


SYNC_CASES = [("sgd", torch.float32, 1e-6), ("adam", torch.float64, 1e-12)]


@pytest.fixture(scope="module")
def sync_worlds() -> dict[str, list[Any]]:
    """Each optimizer's sync world, run at once: their ranks mostly wait on the wire, and
    what they compute does not depend on timing."""
    with ThreadPoolExecutor(len(SYNC_CASES), thread_name_prefix="ps-world") as pool:
        started = {opt: pool.submit(run_ps_world, 2, 2, _sync_job, opt, dtype)
                   for opt, dtype, _ in SYNC_CASES}  # fmt: skip
    return {opt: future.result() for opt, future in started.items()}


@pytest.mark.parametrize("optimizer,dtype,tol", SYNC_CASES)
def test_sync_equals_allreduce_data_parallel(
    sync_worlds: dict[str, list[Any]], optimizer: str, dtype: torch.dtype, tol: float
) -> None:
    ref = _reference(optimizer, dtype)
    for params in sync_worlds[optimizer]:
        for a, b in zip(params, ref, strict=True):
            torch.testing.assert_close(torch.tensor(a, dtype=dtype), b, rtol=tol, atol=tol)


def _ssp_job(role: ps.Role, tau: int) -> dict[str, Any]:
    model = _model(torch.float32)
    client = ps.Client(
        model.named_parameters(), ps.PSConfig(mode="ssp", staleness=tau, slice_mb=0.0005), role
    )
    for _ in range(16):
        if role.rank == role.num_workers - 1:
            time.sleep(0.05)  # the deliberately slow worker
        client.push_pull([torch.ones_like(p) * 1e-3 for p in model.parameters()])
        assert client.clock == _ + 1
    stats = client.stats()
    client.close()
    return stats


def test_ssp_staleness_bound_with_a_slow_worker() -> None:
    tau, workers = 2, 3
    results = run_ps_world(workers, 1, _ssp_job, tau)
    stats = max(results, key=lambda s: s["applied_gradients"])  # read last: saw every push
    assert stats["applied_gradients"] == 16 * workers and stats["dead_workers"] == []
    for s in results:
        assert s["max_clock_staleness"] <= tau and s["max_staleness"] <= (workers - 1) * (
            2 * tau + 1
        ), s
    assert stats["max_clock_staleness"] > 0 and stats["max_staleness"] > 0, stats


AFTER_DEATH = 5  # the steps a survivor takes once the servers declared worker 2 dead


def _death_job(role: ps.Role, mode: str) -> Any:
    """Worker 2 dies at step 3. A survivor steps until the servers have declared it dead
    (worker_timeout_s: 1 s), then AFTER_DEATH more: the job goes on without it; or it gets
    PeerFailureError (sync)."""
    model = _model(torch.float32)
    cfg = ps.PSConfig(mode=mode, staleness=1, worker_timeout_s=1.0, slice_mb=0.0005)
    client = ps.Client(model.named_parameters(), cfg, role)
    grads = [torch.ones_like(p) * 1e-3 for p in model.parameters()]
    start = time.monotonic()
    declared = None  # the step by which the servers had declared worker 2 dead
    step = 0
    while declared is None or step < declared + AFTER_DEATH:
        if role.rank == 2 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3:
            start = time.monotonic()
        if time.monotonic() - start > 30:  # 30 x the timeout: never declared dead
            client.close()
            return ("never declared dead", step)
        try:
            client.push_pull(grads)
            if declared is None and step >= 3 and client.stats()["dead_workers"]:
                declared = step
        except PeerFailureError as e:
            client.close()
            return ("failed", e.rank, time.monotonic() - start, str(e))
        step += 1
    stats = client.stats()
    client.close()
    return ("ok", stats)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_dead_worker_does_not_stop_async_or_ssp(mode: str) -> None:
    results = run_ps_world(3, 1, _death_job, mode, tolerate=[2])
    for r in results[:2]:
        assert r[0] == "ok", r
    assert results[0][1]["dead_workers"] == [2]


def test_sync_survivors_get_peer_failure_naming_the_dead_worker() -> None:
    results = run_ps_world(3, 1, _death_job, "sync", tolerate=[2])
    for r in results[:2]:
        assert r[0] == "failed" and r[1] == 2, r
        assert r[2] < 6.0, r  # worker_timeout_s=1 s plus detection, not a hang
        assert "worker 2" in r[3]


def _bad_messages_job(role: ps.Role) -> list[str]:
    model = _model(torch.float32)
    client = ps.Client(model.named_parameters(), ps.PSConfig(mode="async"), role)
    ctx = zmq.Context()
    endpoint = "tcp://" + role.store.get(store_server_key(0)).decode()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    sessions = []
    for sock, worker in zip(socks, (0, 99), strict=True):  # an authenticated peer's mistakes
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sessions.append(authenticate(sock, job_key(world_from_env()), worker))
    key = client.plan.keys[0]
    good = torch.zeros(key.numel)
    bad: list[list[Any]] = [
        [b"\xc1garbage"],  # not msgpack
        [b"\x80" * 2_000_000],  # oversized header
        encode(Message("push", 10**6, 0, [999], [torch.zeros(3)], [0], clock=1)),  # unknown key
        encode(Message("push", 10**6, 0, [key.key], [torch.zeros(key.numel + 1)], [0])),
        encode(Message("push", 10**6, 0, [key.key], [good], [0]))[:1],  # missing frame
        [*encode(Message("push", 10**6, 0, [key.key], [good], [0]))[:1], b"\0" * 5],  # size
        encode(Message("pull", 10**6, 99)),  # a worker that does not exist
    ]
    reasons = []
    for i, parts in enumerate(bad):
        sock, session = (socks[1], sessions[1]) if i == len(bad) - 1 else (socks[0], sessions[0])
        sock.send_multipart(session.seal(parts))
        assert sock.poll(5000), "no error reply"
        what, frames = session.open(sock.recv_multipart())
        reply = decode(frames)
        assert what == "message" and reply.op == "error", reply
        reasons.append(str(reply.meta["reason"]))
    for sock in socks:
        sock.close()
    ctx.term()
    client.push_pull([torch.zeros_like(p) for p in model.parameters()])  # still serving
    client.close()
    return reasons


def test_bad_messages_get_error_replies_and_the_server_keeps_serving() -> None:
    reasons = run_ps_world(1, 1, _bad_messages_job)[0]
    assert "msgpack" in reasons[0] and "header is" in reasons[1]
    assert "unknown keys [999]" in reasons[2] and "shape" in reasons[3]
    assert "tensor frames" in reasons[4] and "needs" in reasons[5]
    assert "worker 99" in reasons[6]


# -- `plait train --strategy ps` in process: train(config, role) on each worker ------------
CPU = {"PLAIT_DEVICE": "cpu"}  # as `plait train` gives its workers here (a GPU machine too)


def _train_job(
    role: ps.Role, options: dict[str, Any], stop_after: int | None = None
) -> tuple[dict[str, Any], int]:
    """This worker's figures of a `plait train --strategy ps` run (`stop_after`: as if
    interrupted after that step), and how many of its updates went through
    Client.push_pull_async (--priority's: the proof it was on)."""
    config = TrainConfig.from_options({**options, "strategy": "ps", "workers": role.num_workers,
                                       "servers": role.num_servers})  # fmt: skip
    original = Client.push_pull_async
    with mock.patch.object(Client, "push_pull_async", autospec=True, side_effect=original) as m:
        return train(config, role, stop_after=stop_after).figures(), m.call_count


@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_plait_train_ssp_and_async_share_the_slices_out(mode: str, tmp_path: Path) -> None:
    # async: with --out (checkpoints at steps 10 and 20)
    out = {"out": str(tmp_path / "run"), "checkpoint_every": 10} if mode == "async" else {}
    options = {"ps_mode": mode, "steps": 20, "eval_every": 0, **out}
    (data, _), _ = run_ps_world(2, 1, _train_job, options, env=CPU)
    assert (data["strategy"], data["ps_mode"], data["servers"]) == ("ps", mode, 1)
    assert (data["world_size"], data["steps"], data["global_batch"]) == (2, 20, 64)
    assert 0.5 < data["eval_value"] <= 1.0 and data["samples_per_s"] > 0
    assert data["bytes_per_server"][0] > 0 and data["dead_workers"] == []
    # slices are shared out as workers come free: 40 in all
    assert data["applied_gradients"] == 40 and 1 <= data["worker_steps"] <= 39
    assert data["mean_staleness"] <= data["max_staleness"]
    if mode == "ssp":
        assert data["max_staleness"] <= 2 * 4 + 1  # tau 4, at most one update per worker
        return
    # the checkpoint is whole and consistent: its consolidated model is the one worker 0
    # evaluated after the last pull (every slice applied), on every held-out sample alike
    trained = load_run(out["out"])
    assert trained.step == 20 and trained.evals == data["evals"]
    assert (
        evaluate_alone(trained.model, trained.workload, torch.device("cpu")) == data["eval_value"]
    )
    # (a resume's plumbing is sync's, below; the slices it claims: tests/unit/test_train_ps.py)


def test_plait_train_priority_and_a_resumed_run_give_fifos_losses(tmp_path: Path) -> None:
    """--priority (P3's small slices), and a FIFO run (4 MiB slices) stopped after step 4 at
    one server, as if interrupted, then resumed at two: the same losses and held-out metric,
    bit for bit. The first two run at once (nothing they compute depends on timing); the
    values depend neither on the cut nor on the interruption."""
    options, out = {"steps": 8, "eval_every": 0}, str(tmp_path / "run")
    fifo = {**options, "out": out, "checkpoint_every": 4}
    with ThreadPoolExecutor(2, thread_name_prefix="ps-world") as pool:
        started = [pool.submit(run_ps_world, 2, 1, _train_job, o, stop, env=CPU)
                   for o, stop in (({**options, "priority": True, "slice_mb": 0.01}, None),
                                   (fifo, 4))]  # fmt: skip
    prio, stopped = (future.result() for future in started)
    (got, _), (first, _) = prio[0], stopped[0]
    assert [n for _, n in prio] == [8, 7] and [n for _, n in stopped] == [0, 0]  # priority on
    assert got["applied_gradients"] == 16 and got["dead_workers"] == []
    assert first["stopped_at"] == 4 and first["losses"] == got["losses"][:4]
    resumed = run_ps_world(2, 2, _train_job, {**fifo, "resume": True}, env=CPU)
    (want, _), _ = resumed
    assert (got["losses"], got["eval_value"]) == (want["losses"], want["eval_value"])
    assert want["updates_per_server"] == [4, 4]  # steps 5 to 8 only

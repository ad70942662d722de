"""The communicator on CUDA tensors: what one GPU can show (scripts/gpu-check.sh runs these).

Several ranks share the one GPU (PLAIT_SHARE_GPU=1). Staged transport (through pinned host
memory over plait's engine and gloo) runs with any number of ranks per GPU. NCCL refuses
two ranks on one GPU ("Duplicate GPU detected") before NCCL 2.30, which allows it with
NCCL_MULTI_RANK_GPU_ENABLE=1; the NCCL tests skip with that reason where it is older. The
failure tests kill or freeze a rank while the other is blocked in a NCCL collective and need
PeerFailureError naming it within the 15 s bound, as on CPU (tests/world/test_failures.py).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from plait import devices
from plait.errors import PeerFailureError
from support.comm_links import every_collective, ordered_messages
from support.world import run_world

pytestmark = pytest.mark.cuda

SHARE = {"PLAIT_SHARE_GPU": "1", "PLAIT_DEVICE": "cuda"}


def _nccl_shares_a_gpu() -> str | None:
    """Why two ranks cannot run NCCL on this machine's GPUs, or None where they can."""
    return devices.nccl_problem(2)


NCCL_ENV = {**SHARE, "PLAIT_CUDA_TRANSPORT": "nccl", "NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def _devices(comm: object) -> tuple[str, str]:
    import plait

    return str(plait.device()), str(torch.cuda.current_device())


def test_init_selects_cuda_local_rank_and_shares_one_gpu_when_asked():
    got = run_world(2, _devices, env=SHARE)  # no NCCL group is made until a CUDA collective
    count = torch.cuda.device_count()
    assert got == [(f"cuda:{r % count}", str(r % count)) for r in range(2)]


def _single_rank_nccl(comm: object) -> list[float]:
    from plait.comm.backends import process_groups

    device = torch.device("cuda", 0)
    group = comm._runner.nccl_group(device)
    t = torch.arange(4.0, device=device)
    process_groups.allreduce(group, t, "sum").wait()
    torch.cuda.synchronize()
    return t.tolist()


def test_single_rank_nccl():
    assert run_world(1, _single_rank_nccl, env={"PLAIT_DEVICE": "cuda"}) == [[0.0, 1.0, 2.0, 3.0]]


def test_every_collective_on_cuda_tensors_staged_through_the_host():
    env = {**SHARE, "PLAIT_CUDA_TRANSPORT": "staged"}
    for got in run_world(2, every_collective, "cuda", env=env, timeout=180):
        assert got["staged"] > 0 and got["engine_messages"] >= 2, got


def test_every_collective_on_cuda_tensors_over_nccl():
    reason = _nccl_shares_a_gpu()
    if reason:
        pytest.skip(reason)
    for got in run_world(2, every_collective, "cuda", env=NCCL_ENV, timeout=180):
        assert got["engine_messages"] == 0, got  # the ring's data went over NCCL


def test_ordered_messages_over_nccl_lanes():
    """The pipeline's payloads: both ways at once between neighbours, over NCCL, in order."""
    if reason := devices.nccl_problem(3):
        pytest.skip(reason)
    for r, got in enumerate(run_world(3, ordered_messages, "cuda", env=NCCL_ENV, timeout=120)):
        assert got["engine_messages"] == 0, got
        assert got["got"] == {q: [10.0 * q + k for k in range(3)] for q in got["got"]}, (r, got)


def _async_on_the_communication_stream(comm: object) -> dict[str, object]:
    """allreduce_async waits on the GPU for what the caller queued before it (a fill behind a
    long sleep: without the hand-off's ready event it would read zeros), and wait() orders
    the caller's stream after it (the sum read back afterwards is right)."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1 << 20, device=device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the caller's stream
    x.fill_(float(comm.rank + 1))  # queued behind the sleep
    request = comm.allreduce_async_(x)
    total = request.wait()
    y = total + 0  # queued after the collective on the caller's stream
    torch.cuda.synchronize()
    request.synchronize()
    return {"value": float(y[0]), "same": total.data_ptr() == x.data_ptr()}


@pytest.mark.parametrize("transport", ["staged", "nccl"])
def test_async_collectives_hand_off_to_the_communication_stream(transport):
    env = {**SHARE, "PLAIT_CUDA_TRANSPORT": transport, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    if transport == "nccl" and (reason := _nccl_shares_a_gpu()):
        pytest.skip(reason)
    for got in run_world(2, _async_on_the_communication_stream, env=env, timeout=120):
        assert got == {"value": 3.0, "same": True}


def _nested_splits(comm: object) -> list[float]:
    """Sub-communicators of sub-communicators each get their NCCL group (made by their members
    only), without the deadlock new_group has when not every rank calls it."""
    device = torch.device("cuda", torch.cuda.current_device())
    half = comm.split(color=comm.rank % 2)
    single = half.split(ranks=[0])
    if single is not None:
        assert single.size == 1
    x = torch.ones(8, device=device)
    return [
        float(comm.allreduce(x, algorithm="native")[0]),
        float(half.allreduce(x, algorithm="native")[0]),
    ]


def test_nested_splits_get_their_own_nccl_groups():
    if reason := _nccl_shares_a_gpu():
        pytest.skip(reason)
    assert run_world(4, _nested_splits, env=NCCL_ENV, timeout=180) == [[4.0, 2.0]] * 4


def _blocked_in_nccl(comm: object, how: str) -> tuple[str, int | None, float, float]:
    """Both ranks run NCCL allreduces (check=False: no exchange over the engine first, so
    the survivor really waits in NCCL) until rank 1 dies or freezes; rank 0 must raise
    PeerFailureError naming it within the bound, and its GPU must come free (the abort)."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(1 << 22, device=device)
    start = time.monotonic()
    try:
        while True:
            if comm.rank == 1 and time.monotonic() - start > 1.0:
                os.kill(os.getpid(), getattr(signal, how))
                time.sleep(60)
            began = time.monotonic()
            comm.allreduce_async_(x, algorithm="native", check=False).synchronize()
    except PeerFailureError as e:
        seconds = time.monotonic() - began
        freed = time.monotonic()
        torch.cuda.synchronize()  # returns because plait aborted the NCCL communicator
        return type(e).__name__, e.rank, seconds, time.monotonic() - freed


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_or_frozen_in_nccl_is_named_within_15s(how):
    if reason := _nccl_shares_a_gpu():
        pytest.skip(reason)
    got = run_world(2, _blocked_in_nccl, how, env=NCCL_ENV, tolerate=[1], timeout=60)
    kind, rank, seconds, unblocked = got[0]
    assert (kind, rank) == ("PeerFailureError", 1), got
    assert seconds < 15 and unblocked < 5, got

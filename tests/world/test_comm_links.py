"""The paths CUDA tensors take, checked on CPU tensors where no GPU is needed.

A CUDA tensor's collective runs plait's schedules over point-to-point on a process group
(NCCL's, device_links.GroupLink) or staged through host memory over the engine
(cuda.staged, device_links.StagedLink). PLAIT_TEST_LINK sends CPU tensors down the same
code: "group" over the gloo group's point-to-point, "staged" through host copies. Every
collective must then give what one process computes, and the structure must show the data
really took that path (the engine carried none of a group-link allreduce's bytes). The
NCCL calls themselves and the CUDA streams run only on a GPU (tests/world/test_comm_cuda.py);
the choice of transport, decided without a world, is in tests/unit/test_transport_choice.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from plait.errors import PeerFailureError
from support.comm_links import every_collective, ordered_messages
from support.world import run_world


@pytest.mark.parametrize("link", ["group", "staged"])
def test_every_collective_over_the_links_cuda_tensors_take(link):
    results = run_world(3, every_collective, env={"PLAIT_TEST_LINK": link}, timeout=120)
    for got in results:
        if link == "group":  # plait's schedules over gloo's point-to-point: not the engine
            assert got["engine_messages"] == 0, got
            # the rows a GPU cannot run over NCCL (none here but auto's shm) are staged
        else:  # every row staged through a host copy, then plait's engine
            assert got["engine_messages"] >= 2 * (3 - 1), got
            assert got["staged"] > 0, got


def test_without_a_test_link_nothing_is_staged():
    results = run_world(2, every_collective, timeout=120)
    assert all(r["staged"] == 0 and r["engine_messages"] >= 2 for r in results)


def test_ordered_messages_go_over_their_lanes_in_sending_order():
    results = run_world(3, ordered_messages, env={"PLAIT_TEST_LINK": "group"}, timeout=60)
    for r, res in enumerate(results):
        assert res["engine_messages"] == 0, res
        assert res["got"] == {q: [10.0 * q + k for k in range(3)] for q in res["got"]}, (r, res)


def _hook_sees_the_death(comm: object) -> dict[str, object]:
    seen: list[tuple[float, int]] = []
    comm.engine.on_failure(lambda err: seen.append((time.monotonic(), err.rank)))
    if comm.rank == 1:
        time.sleep(0.5)
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.allreduce(torch.ones(4), algorithm="ring")
    except PeerFailureError as e:
        raised = e.rank
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    late: list[int] = []
    comm.engine.on_failure(lambda err: late.append(err.rank))  # after the failure: at once
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        "raised": raised,
        "hook": seen and seen[0][1],
        "after": seen and seen[0][0] - start,
        "late": late,
    }


def test_a_failure_runs_the_hooks_that_abort_nccl():
    results = run_world(
        2, _hook_sees_the_death, tolerate=[1], timeout=60, env={"PLAIT_HEARTBEAT_TIMEOUT": "2"}
    )
    got = results[0]
    assert got["raised"] == 1 and got["hook"] == 1 and got["late"] == [1], got
    assert got["after"] < 5, got


def _nothing(comm: object) -> None:
    return None


def test_a_bad_transport_fails_every_rank_at_init_without_a_hang():
    from support.world import WorldError

    start = time.monotonic()
    with pytest.raises(WorldError, match="PLAIT_CUDA_TRANSPORT must be auto, nccl or staged"):
        run_world(2, _nothing, env={"PLAIT_CUDA_TRANSPORT": "fast"}, timeout=60)
    assert time.monotonic() - start < 30

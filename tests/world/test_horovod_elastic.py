"""hvd.elastic through plait's facade (issue 33): a Horovod-style elastic script
(support/horovod_elastic.py) in a job of 3 processes that a 4th joins, then one of the
first SIGKILLs itself in the middle of a step. One world checks: the join raises
HostsUpdatedInterrupt at a commit and the joiner takes the state; the kill surfaces as
HorovodInternalError (also plait's PeerFailureError, naming the rank) in a facade op; the
survivors go back to the last commit, re-form, run the reset callbacks and finish; each
sample is trained on once per epoch across both changes; the final parameters are those
of one process that makes the same changes as planned events."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support import horovod_elastic as script
from support.world import run_world

pytestmark = pytest.mark.timeout(120)
ENV = {"PLAIT_HEARTBEAT_TIMEOUT": "2", "PLAIT_TIMEOUT": "30"}


@pytest.fixture(scope="module")
def survivors() -> list[dict[str, Any]]:
    results = run_world(4, script.scenario, timeout=90, env=ENV, joiners=1, tolerate=[0])
    return [r for r in results if isinstance(r, dict)]


def test_the_survivors_of_a_kill_that_followed_a_join_finish(
    survivors: list[dict[str, Any]],
) -> None:
    assert sorted(r["first"] for r in survivors) == [1, 2, 3], survivors
    for r in survivors:
        # ranks renumbered in the old order, the joiner last; the callback's learning rate
        assert (r["rank"], r["size"]) == (r["first"] - 1, 3), r
        assert r["lr"] == pytest.approx(script.BASE_LR * 3), r
        # the joiner lived through the kill only; the first ranks through the join too
        assert r["resets"] == (1 if r["first"] == 3 else 2), r
        # the facade op that met the dead rank raised Horovod's error, also plait's
        assert r["errors"] == [{"peer_failure": True, "rank": 0, "size": 4}], r


def test_each_sample_is_trained_on_once_per_epoch(survivors: list[dict[str, Any]]) -> None:
    planned = script.steps()
    for r in survivors:
        # the committed steps only: the lost one was rolled back with the state
        assert [tuple(s) for s in r["seen"]] == planned, r["seen"]
        for epoch in range(script.EPOCHS):
            ids = sorted(i for e, _, step in r["seen"] if e == epoch for i in step)
            assert ids == list(range(script.SAMPLES)), (epoch, ids)


def test_the_parameters_equal_the_planned_reference(survivors: list[dict[str, Any]]) -> None:
    want = script.reference()
    for r in survivors:
        # 1e-12, not bit for bit: the ranks average their batches' mean gradients in the
        # allreduce's order, the reference takes one mean over the global batch
        for got, ref in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-12, atol=0)

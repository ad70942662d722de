"""plait.horovod.torch in real worlds of 2-4 processes, checked as Horovod's own tests check.

Every body runs at any world size (results are compared with formulas in the size, Horovod
style: `allreduce(t, op=Sum) == t * size`). A world is spawned once per size and runs the
sections of `battery` in order; each rank collects its failed checks by section, and each
test below asserts one section on every rank. Training checks compare against a single
process that sees the whole batch (float64, tight tolerance). The sections are in
tests/support/horovod_collectives.py and horovod_training.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from plait import Communicator
from support import horovod_collectives as collectives
from support import horovod_training as training
from support.horovod_checks import ENV, Checks, assert_section
from support.world import worlds_at_once

pytestmark = pytest.mark.timeout(90)

Failures = dict[str, list[str]]  # one rank's failed checks by section


def check_init(hvd: Any, ck: Checks, comm: Communicator) -> None:
    hvd.init()
    hvd.init()  # idempotent, like Horovod's
    ck.equal("size", hvd.size(), comm.size)
    ck.equal("rank", hvd.rank(), comm.rank)


def check_shutdown(hvd: Any, ck: Checks) -> None:
    hvd.shutdown()
    ck.true("shutdown", not hvd.is_initialized())
    ck.raises("size after shutdown", ValueError, hvd.size, "use hvd.init()")


def _sections(*modules: Any) -> list[str]:
    """The sections of `modules`, in the order they are written (the order they run)."""
    return [name[6:] for m in modules for name in vars(m) if name.startswith("check_")]


ALL = _sections(collectives, training)
# four ranks train and join only (DistributedOptimizer's sections, then join's)
AT_FOUR = [
    *("optimizer", "overlap", "accumulation", "clipping", "unused_parameter"),
    *("optimizer_arguments", "join", "join_refusals", "join_in_training"),
    "join_without_the_call_check",
]
WORLDS = {2: ALL, 3: ALL, 4: AT_FOUR}  # size -> the sections its world runs


def battery(comm: Communicator, sections: list[str]) -> Failures:
    """hvd.init(), the sections in order, hvd.shutdown(): each section's failed checks."""
    import plait.horovod.torch as hvd

    checks: dict[str, Callable[..., None]] = {}
    for name in sections:
        module = collectives if hasattr(collectives, f"check_{name}") else training
        checks[name] = getattr(module, f"check_{name}")
    ck = Checks()
    ck.begin("init")
    check_init(hvd, ck, comm)
    ck.run(hvd, checks)
    ck.begin("shutdown")
    check_shutdown(hvd, ck)
    return ck.failures


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[list[Failures]]]]:
    """Every world of WORLDS, started at once (their ranks mostly wait for each other)."""
    calls = {n: (n, battery, (WORLDS[n],), {"timeout": 80, "env": ENV}) for n in WORLDS}
    with worlds_at_once(calls) as worlds:
        yield worlds


@pytest.fixture(scope="module")
def world(
    request: pytest.FixtureRequest, started: dict[int, Future[list[Failures]]]
) -> list[Failures]:
    """The world of `request.param` ranks, spawned once for every test that asks for it."""
    return started[request.param].result()


every_world = pytest.mark.parametrize("world", list(WORLDS), indirect=True)
two_and_three = pytest.mark.parametrize("world", [2, 3], indirect=True)  # not in AT_FOUR


@every_world
def test_init_is_idempotent_and_knows_the_world(world: list[Failures]) -> None:
    assert_section(world, "init")


@two_and_three
def test_facts_about_the_job(world: list[Failures]) -> None:
    assert_section(world, "facts")


@two_and_three
def test_allreduce_every_op_with_and_without_scaling(world: list[Failures]) -> None:
    assert_section(world, "allreduce_ops")


@two_and_three
def test_fp16_and_bf16_compression(world: list[Failures]) -> None:
    assert_section(world, "compression")


@two_and_three
def test_in_place_async_poll_and_synchronize(world: list[Failures]) -> None:
    assert_section(world, "async")


@two_and_three
def test_grouped_allreduce(world: list[Failures]) -> None:
    assert_section(world, "grouped")


@two_and_three
def test_allgather_of_uneven_rows(world: list[Failures]) -> None:
    assert_section(world, "allgather")


@two_and_three
def test_broadcast_from_every_root(world: list[Failures]) -> None:
    assert_section(world, "broadcast")


@two_and_three
def test_alltoall_with_and_without_splits(world: list[Failures]) -> None:
    assert_section(world, "alltoall")


@two_and_three
def test_reducescatter(world: list[Failures]) -> None:
    assert_section(world, "reducescatter")


@two_and_three
def test_objects_and_the_barrier(world: list[Failures]) -> None:
    assert_section(world, "objects")


@two_and_three
def test_mismatched_calls_fail_alike_on_every_rank(world: list[Failures]) -> None:
    assert_section(world, "mismatch")


@two_and_three
def test_process_sets(world: list[Failures]) -> None:
    assert_section(world, "process_sets")


@two_and_three
def test_the_gradient_of_every_collective(world: list[Failures]) -> None:
    assert_section(world, "gradients")


@every_world
def test_distributed_optimizer_trains_like_one_process(world: list[Failures]) -> None:
    assert_section(world, "optimizer")


@every_world
def test_buckets_start_during_backward(world: list[Failures]) -> None:
    assert_section(world, "overlap")


@every_world
def test_backward_passes_per_step_accumulate(world: list[Failures]) -> None:
    assert_section(world, "accumulation")


@every_world
def test_clipping_inside_skip_synchronize(world: list[Failures]) -> None:
    assert_section(world, "clipping")


@every_world
def test_a_parameter_without_a_gradient_gets_zeros(world: list[Failures]) -> None:
    assert_section(world, "unused_parameter")


@every_world
def test_distributed_optimizer_checks_its_arguments(world: list[Failures]) -> None:
    assert_section(world, "optimizer_arguments")


@two_and_three
def test_broadcast_parameters(world: list[Failures]) -> None:
    assert_section(world, "broadcast_parameters")


@two_and_three
def test_broadcast_optimizer_state(world: list[Failures]) -> None:
    assert_section(world, "broadcast_optimizer_state")


@every_world
def test_join_answers_the_last_rank_everywhere(world: list[Failures]) -> None:
    assert_section(world, "join")


@every_world
def test_join_serves_barrier_and_min_max_and_refuses_the_rest(world: list[Failures]) -> None:
    assert_section(world, "join_refusals")


@every_world
def test_join_in_training_with_uneven_data(world: list[Failures]) -> None:
    assert_section(world, "join_in_training")


@every_world
def test_join_without_the_call_check_refuses_at_once(world: list[Failures]) -> None:
    assert_section(world, "join_without_the_call_check")


@every_world
def test_shutdown_ends_the_session(world: list[Failures]) -> None:
    assert_section(world, "shutdown")

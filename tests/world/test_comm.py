"""The Communicator in real worlds of 1-4 processes, against single-process torch references.

A world is spawned once per size (and once more at 3 ranks with PLAIT_CHECK=0, which skips
the mismatch check, not the answers) and runs every section of `battery`; the five worlds
run at once (their ranks mostly wait for each other's messages). Each rank builds
every rank's inputs itself (small integers from a generator seeded by the rank, so sums and
products are exact in every dtype) and computes the torch reference, so the same body runs
at any world size (Horovod style). Each rank collects its failed checks by section rather
than stopping at the first, with the results every rank must share; each test below asserts
one section on every rank, and that the ranks agree on its results bit for bit. The checks
themselves are in tests/support/comm_reductions.py and comm_exchanges.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from plait import Communicator
from support.comm_checks import DTYPES, Checks, Report, assert_section
from support.comm_exchanges import (
    check_barrier,
    check_gathers,
    check_p2p_and_objects,
    check_split,
    check_structure,
)
from support.comm_reductions import (
    check_allreduce,
    check_async,
    check_async_forms,
    check_broadcast_reduce,
    check_routes,
)
from support.world import worlds_at_once

# one world per test id: (size, environment), all started with the module's first test
ENV = {"PLAIT_TIMEOUT": "20"}  # a hang becomes a CommTimeoutError with a traceback
WORLDS = {
    "1": (1, ENV),
    "2": (2, ENV),
    "3": (3, ENV),
    "4": (4, ENV),
    "3-unchecked": (3, {**ENV, "PLAIT_CHECK": "0"}),  # message counts need no baseline
}
pytestmark = pytest.mark.timeout(150)


def check_attributes(comm: Communicator, ck: Checks) -> None:
    p, r = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    got = (comm.rank, comm.size, comm.local_rank, comm.local_size, comm.node_rank, comm.num_nodes)
    ck.true("attributes", got == (r, p, r, p, 0, 1), got)


# in the order they run: a section's inputs come from the seeds the sections before it drew
SECTIONS: dict[str, Callable[[Communicator, Checks], None]] = {
    "attributes": check_attributes,
    "allreduce": lambda comm, ck: check_allreduce(comm, ck, DTYPES),
    "async": check_async,
    "async_forms": check_async_forms,
    "routes": check_routes,
    "broadcast_reduce": lambda comm, ck: check_broadcast_reduce(comm, ck, DTYPES),
    "gathers": lambda comm, ck: check_gathers(comm, ck, DTYPES),
    "p2p_and_objects": check_p2p_and_objects,
    "structure": check_structure,
    "barrier": check_barrier,
    "split": check_split,
}


def battery(comm: Communicator) -> Report:
    """Every section, in one world: each section's failed checks and shared results."""
    ck = Checks(comm.rank)
    for name, check in SECTIONS.items():
        ck.begin(name)
        check(comm, ck)
    return ck.failures, ck.shared


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, Future[list[Report]]]]:
    """Every world of WORLDS, started at once."""
    calls = {key: (size, battery, (), {"timeout": 120, "env": env})
             for key, (size, env) in WORLDS.items()}  # fmt: skip
    with worlds_at_once(calls) as worlds:
        yield worlds


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request: pytest.FixtureRequest, started: dict[str, Future[list[Report]]]) -> list[Report]:
    return started[request.param].result()


def test_attributes_are_the_worlds(world: list[Report]) -> None:
    assert_section(world, "attributes")


def test_allreduce_every_algorithm_dtype_op_and_shape(world: list[Report]) -> None:
    assert_section(world, "allreduce")
    assert all(shared["allreduce"] for _, shared in world)  # the ranks' agreement was checked


def test_async_allreduce_finishes_in_issue_order(world: list[Report]) -> None:
    assert_section(world, "async")


def test_async_forms_give_what_the_blocking_forms_give(world: list[Report]) -> None:
    assert_section(world, "async_forms")


def test_each_algorithm_runs_the_row_the_routing_table_names(world: list[Report]) -> None:
    assert_section(world, "routes")


def test_broadcast_and_reduce_from_every_root(world: list[Report]) -> None:
    assert_section(world, "broadcast_reduce")


def test_allgather_reduce_scatter_alltoall_gather_and_scatter(world: list[Report]) -> None:
    assert_section(world, "gathers")


def test_point_to_point_and_objects(world: list[Report]) -> None:
    assert_section(world, "p2p_and_objects")


def test_ring_and_halving_doubling_send_only_to_their_partners(world: list[Report]) -> None:
    assert_section(world, "structure")


def test_barrier_waits_for_the_last_rank(world: list[Report]) -> None:
    assert_section(world, "barrier")


def test_split_communicators_run_the_collectives_too(world: list[Report]) -> None:
    assert_section(world, "split")

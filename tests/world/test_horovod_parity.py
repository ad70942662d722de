"""Horovod's documented behaviour, item by item, at 2 and 3 ranks (issue 20).

Each section states what Horovod does; plait.horovod.torch (and, where the rule is the
Communicator's, `Communicator.allreduce`) must do the same. One world per size runs every
section (a process costs seconds to start here); each rank collects its failed checks by
section, and each test asserts one section on every rank.
Adasum, sparse gradients and SyncBatchNorm have files of their own
(test_horovod_adasum.py, test_horovod_sparse.py, test_horovod_syncbn.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed as dist

from support.horovod_checks import (
    ENV,
    Checks,
    assert_section,
    make_batch,
    make_model,
    mse,
    same_params,
)
from support.horovod_names import (
    check_duplicate_names,
    check_hooks_in_any_order,
    check_names_in_any_order,
)
from support.world import worlds_at_once

pytestmark = pytest.mark.timeout(150)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
ALGORITHMS = ("native", "ring", "tree", "halving_doubling", "shm")  # hierarchical: 1 host here


def check_integer_averages(hvd: Any, ck: Checks, comm: Any) -> None:
    """Horovod divides an integer sum by the size as C does, toward zero: averaging
    [-75, 75, -3, 3] (rank 0) with zeros is [-37, 37, -1, 1] at 2 ranks, where Python's //
    would give [-38, 37, -2, 1]; through hvd.allreduce and every Communicator algorithm."""
    n = comm.size
    mine = [-75, 75, -3, 3] if comm.rank == 0 else [0, 0, 0, 0]
    for dtype in INTS:
        values = [abs(v) for v in mine] if dtype == torch.uint8 else mine
        want = torch.tensor(
            [
                int(v / n)
                for v in (
                    [abs(v) for v in (-75, 75, -3, 3)] if dtype == torch.uint8 else (-75, 75, -3, 3)
                )
            ],
            dtype=dtype,
        )
        t = torch.tensor(values, dtype=dtype)
        ck.equal(f"avg {dtype} hvd", hvd.allreduce(t, op=hvd.Average), want)
        ck.equal(f"avg {dtype} postscale", hvd.allreduce(t, postscale_factor=1.0), want)
        for a in ALGORITHMS:
            if a == "native" and dtype == torch.int16:
                continue  # gloo has no int16 ("Invalid scalar type"): torch's, not a rule
            ck.equal(f"avg {dtype} {a}", comm.allreduce(t, op="avg", algorithm=a), want)


def check_same_name_in_flight(hvd: Any, ck: Checks, comm: Any) -> None:
    """An async op submitted while another of the same name is in progress is an error
    (allreduce, allgather, broadcast, reducescatter, alltoall); the name is free again once
    the first has finished. Alltoall without splits needs dim 0 divisible by the size."""
    t = torch.arange(6, dtype=torch.float32)  # 6 rows: divisible by 2 and by 3
    starts = {
        "allreduce": lambda n: hvd.allreduce_async(t, name=n),
        "allgather": lambda n: hvd.allgather_async(t, name=n),
        "broadcast": lambda n: hvd.broadcast_async(t, root_rank=0, name=n),
        "reducescatter": lambda n: hvd.reducescatter_async(t, name=n),
        "alltoall": lambda n: hvd.alltoall_async(t, name=n),
    }
    # one name per op (a name is refused whatever the op), all five in flight at once: rank 0
    # posts its firsts and the seconds before the others post theirs (the barrier), so none
    # of its firsts can have run yet
    firsts = {}
    if comm.rank == 0:
        firsts = {what: start(f"x-{what}") for what, start in starts.items()}
        for what, start in starts.items():
            ck.raises(f"second {what} 'x-{what}'", ValueError,
                      lambda s=start, n=f"x-{what}": s(n), f"cannot {what}")  # fmt: skip
    hvd.barrier()
    if comm.rank != 0:
        firsts = {what: start(f"x-{what}") for what, start in starts.items()}
    for first in firsts.values():
        hvd.synchronize(first)
    for what, start in starts.items():
        hvd.synchronize(start(f"x-{what}"))  # finished: the name is free again
    ck.raises("alltoall 7 rows", ValueError, lambda: hvd.alltoall(torch.zeros(7, 2)), "dim 0 is 7")


def check_process_sets(hvd: Any, ck: Checks, comm: Any) -> None:
    """root_rank is a rank of the whole job, inside a process set too: the set of ranks
    1..n-1 broadcasts from global rank n-1 (its last member); a root outside the set and a
    rank outside the set are refused."""
    n, r = comm.size, comm.rank
    ck.equal("global set ranks", hvd.global_process_set.ranks, list(range(n)))
    ck.equal("global set rank", hvd.global_process_set.rank(), r)
    hvd.init(process_sets="dynamic")  # Horovod's flag for sets added later: accepted
    ck.raises("process_sets='static'", ValueError, lambda: hvd.init(process_sets="static"))
    tail = hvd.add_process_set(list(range(1, n)))
    ck.equal("set rank", tail.rank(), r - 1 if r else -1)
    root = n - 1
    if not tail.included():
        ck.raises(
            "non-member",
            ValueError,
            lambda: hvd.broadcast(torch.ones(1), root, process_set=tail),
            "not in",
        )
    else:
        mine = torch.full((3,), float(r))
        want = torch.full((3,), float(root))
        ck.equal("broadcast", hvd.broadcast(mine, root, process_set=tail), want)
        ck.equal("broadcast_", hvd.broadcast_(mine.clone(), root, process_set=tail), want)
        h = hvd.broadcast_async(mine, root, process_set=tail)
        ck.equal("broadcast_async", hvd.synchronize(h), want)
        ck.equal(
            "broadcast_object",
            hvd.broadcast_object(("from", r), root, process_set=tail),
            ("from", root),
        )
        x = torch.ones(2, requires_grad=True)  # the gradient reaches the root only
        hvd.broadcast(x * (r + 1), root, process_set=tail).sum().backward()
        ck.equal("broadcast grad", x.grad, torch.full((2,), float(r + 1) if r == root else 0.0))
        model = make_model(seed=r)
        hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=tail)
        same_params(ck, "broadcast_parameters", model, make_model(seed=root))
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
        hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=tail)
        ck.equal("optimizer state lr", opt.param_groups[0]["lr"], 0.1 * (root + 1))
        ck.raises(
            "root outside the set",
            ValueError,
            lambda: hvd.broadcast(mine, 0, process_set=tail),
            "process set's ranks",
        )
        # DistributedOptimizer on the set averages over its members only
        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), process_set=tail
        )
        x, y = make_batch(0, n, 2)
        mse(model, x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]).backward()
        opt.step()
        ref = make_model()
        mse(ref, x[2:], y[2:]).backward()  # the members' rows: the mean of their means
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
        same_params(ck, "DistributedOptimizer on a set", model, ref)
    hvd.remove_process_set(tail)


def check_join_refusals(hvd: Any, ck: Checks, comm: Any) -> None:
    """While a rank has joined, Horovod serves allreduce (zeros) and refuses allgather,
    broadcast and alltoall on the ranks that call them ("... is not supported with Join at
    this time", a HorovodInternalError); the joined rank stays joined."""
    n, r = comm.size, comm.rank
    if r == 0:
        last = hvd.join()
    else:
        for what, call in (
            ("Allgather", lambda: hvd.allgather(torch.ones(1, 2))),
            ("Broadcast", lambda: hvd.broadcast(torch.ones(2), n - 1)),
            ("Alltoall", lambda: hvd.alltoall(torch.ones(n))),
        ):
            ck.raises(
                f"join: {what}",
                hvd.HorovodInternalError,
                call,
                f"{what} is not supported with Join",
            )
        ck.equal(
            "join: allreduce served",
            hvd.allreduce(torch.ones(2), op=hvd.Sum),
            torch.full((2,), n - 1.0),
        )
        last = hvd.join()
    ck.equal("join: last", last, n - 1)


def check_optimizer_state(hvd: Any, ck: Checks, comm: Any) -> None:
    """broadcast_optimizer_state on a fresh optimizer: Horovod first takes a zero-gradient
    step, so `p.grad` exists (zeros) and weight decay has moved the parameters as that step
    does; a stateless optimizer (SGD without momentum) then has nothing to broadcast."""
    r = comm.rank
    for wrap in (False, True):
        model = make_model()
        opt: Any = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), weight_decay=0.5)
        if wrap:
            opt = hvd.DistributedOptimizer(opt)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        ref = make_model()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01 * (r + 1), weight_decay=0.5)
        for p in ref.parameters():
            p.grad = torch.zeros_like(p)
        ref_opt.step()
        tag = "DistributedOptimizer" if wrap else "Adam"
        ck.true(
            f"{tag}: zero grads",
            all(p.grad is not None and not p.grad.any() for p in model.parameters()),
        )
        ck.equal(f"{tag}: root's lr", opt.param_groups[0]["lr"], 0.01)
        ck.equal(f"{tag}: state", len(opt.state_dict()["state"]), 4)
        # each rank steps with its own lr, before the root's options arrive (as in Horovod)
        same_params(ck, f"{tag}: the zero step moved the parameters", model, ref, tol=1e-12)
    if comm.size == 2:  # Adasum's optimizer (a power of 2 of ranks): only the root has state
        model = make_model()
        adam = torch.optim.Adam(model.parameters())
        if r == 0:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            adam.step()
        opt = hvd.DistributedOptimizer(adam, op=hvd.Adasum)
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # rank 1's zero step: no collective
        steps = [int(e["step"]) for e in opt.state_dict()["state"].values()]
        ck.equal("Adasum optimizer: the root's state", steps, [1] * 4)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1))
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    ck.equal("stateless SGD: lr not broadcast", sgd.param_groups[0]["lr"], 0.1 * (r + 1))
    ck.true("stateless SGD: zero grads", all(p.grad is not None for p in model.parameters()))
    emb = torch.nn.Embedding(5, 2, sparse=True)
    sparse = torch.optim.SparseAdam(emb.parameters())
    hvd.broadcast_optimizer_state(sparse, root_rank=0)
    ck.equal("SparseAdam: state", len(sparse.state_dict()["state"]), 1)


def check_build_flags(hvd: Any, ck: Checks, comm: Any) -> None:
    """The *_built()/*_enabled() answers are facts about this job: no MPI, gloo for the
    process group, NCCL and CUDA as this torch was built."""
    ck.equal("mpi_enabled", hvd.mpi_enabled(), False)
    ck.equal("mpi_built", hvd.mpi_built(), False)
    ck.equal("gloo_enabled", hvd.gloo_enabled(), dist.get_backend() == "gloo")
    ck.equal("gloo_built", hvd.gloo_built(), dist.is_gloo_available())
    ck.equal("nccl_built", bool(hvd.nccl_built()), dist.is_nccl_available())
    ck.equal("cuda_built", hvd.cuda_built(), torch.version.cuda is not None)
    ck.equal("rocm_built", hvd.rocm_built(), torch.version.hip is not None)
    ck.equal("ddl_built", hvd.ddl_built(), False)
    ck.equal("ccl_built", hvd.ccl_built(), False)


# in the order they are written, which is the order they run
SECTIONS = {name[6:]: check for name, check in list(globals().items()) if name.startswith("check_")}
SECTIONS.update(  # negotiation by name (issue 33): support/horovod_names.py
    duplicate_names=check_duplicate_names,
    names_in_any_order=check_names_in_any_order,
    hooks_in_any_order=check_hooks_in_any_order,
)


def battery(comm: Any) -> dict[str, list[str]]:
    """Every section in one world: each section's failed checks on this rank."""
    import plait.horovod.torch as hvd

    hvd.init()
    ck = Checks()
    ck.run(hvd, SECTIONS, comm)
    hvd.shutdown()
    return ck.failures


Failures = dict[str, list[str]]  # one rank's failed checks by section
SIZES = [2, 3]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[list[Failures]]]]:
    """Both worlds, started at once (their ranks mostly wait for each other's messages)."""
    with worlds_at_once({n: (n, battery, (), {"timeout": 130, "env": ENV}) for n in SIZES}) as w:
        yield w


@pytest.fixture(scope="module", params=SIZES)
def world(
    request: pytest.FixtureRequest, started: dict[int, Future[list[Failures]]]
) -> list[Failures]:
    return started[request.param].result()


def test_integer_averages_round_toward_zero(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "integer_averages")


def test_the_same_name_in_flight_is_an_error(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "same_name_in_flight")


def test_horovods_duplicate_name_tests(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "duplicate_names")


def test_named_ops_meet_by_name_in_any_order(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "names_in_any_order")


def test_optimizer_hooks_fire_in_any_order(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "hooks_in_any_order")


def test_process_sets_take_global_roots(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "process_sets")


def test_join_serves_allreduce_and_refuses_the_rest(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "join_refusals")


def test_broadcast_optimizer_state_of_a_fresh_optimizer(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "optimizer_state")


def test_build_flags_are_facts_about_this_job(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "build_flags")

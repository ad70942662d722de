"""The Communicator's errors in real worlds: calls that disagree across ranks, invalid arguments.

A mismatch must raise the same CollectiveMismatchError on every rank, naming what each rank
passed, and leave the ranks in step: the next collective works. Invalid arguments raise
ValueError or TypeError before anything is sent, with the accepted values in the message.
One world of 3 ranks runs every disagreement once and reports by section, one test each; a
world of one runs the invalid arguments. The hierarchy of the errors is in
tests/unit/test_errors.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from plait import CollectiveMismatchError, Communicator, PlaitError
from plait.comm.dispatch import auto
from plait.comm.transport.shared_memory import ShmError
from support.world import run_world

ALGOS = ["auto", "native", "ring", "halving_doubling", "tree"]

# (name, what rank r of p calls, the pieces rank q's line of the message must show)
Case = tuple[str, Callable[[Communicator, int, int], object], Callable[[int, int], list[str]]]


def _x(n: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(n, dtype=dtype)


def _auto_chosen_otherwise(c: Communicator, r: int, p: int) -> object:
    """Rank 1's cost model picks another algorithm than the others' for the same call (as a
    stale calibration file would make it): an error naming the choices, not a wait."""
    real = auto.choose
    if r == 1:
        auto.choose = lambda kind, n, topo: "tree" if real(kind, n, topo) != "tree" else "ring"
    try:
        return c.allreduce(_x())
    finally:
        auto.choose = real


MISMATCHES: list[Case] = [
    (
        "shape",
        lambda c, r, p: c.allreduce(_x(3 if r == 1 else 2)),
        lambda q, p: ["allreduce(", f"shape=({3 if q == 1 else 2},)"],
    ),
    (
        "dtype",
        lambda c, r, p: c.allreduce(_x(2, torch.float64 if r == 0 else torch.float32)),
        lambda q, p: ["allreduce(", "dtype=float64" if q == 0 else "dtype=float32"],
    ),
    (
        "op",
        lambda c, r, p: c.allreduce(_x(), op="max" if r == p - 1 else "sum"),
        lambda q, p: ["allreduce(", "op=max" if q == p - 1 else "op=sum"],
    ),
    (
        "kind",
        lambda c, r, p: c.broadcast(_x()) if r == 0 else c.allreduce(_x()),
        lambda q, p: ["broadcast(" if q == 0 else "allreduce("],
    ),
    (
        "root",
        lambda c, r, p: c.broadcast(_x(), root=r),
        lambda q, p: ["broadcast(", f"root={q}"],
    ),
    (
        "algorithm",
        lambda c, r, p: c.allreduce(_x(), algorithm="tree" if r == 1 else "ring"),
        lambda q, p: ["allreduce(", "algorithm=tree" if q == 1 else "algorithm=ring"],
    ),
    (
        "auto chosen otherwise",
        _auto_chosen_otherwise,
        lambda q, p: ["allreduce(", "algorithm=auto:"],
    ),
    (
        "native shape",  # caught before gloo sees it
        lambda c, r, p: c.allreduce(_x(2 + r), algorithm="native"),
        lambda q, p: [f"shape=({2 + q},)", "algorithm=native"],
    ),
    (
        "reduce root",
        lambda c, r, p: c.reduce(_x(), root=min(r, 1)),
        lambda q, p: ["reduce(", f"root={min(q, 1)}"],
    ),
    (
        "allgather trailing dims",  # dim 0 may differ, the others may not
        lambda c, r, p: c.allgather(torch.ones(1 + r, 4 if r == 0 else 3)),
        lambda q, p: ["allgather(", f"shape=({1 + q}, {4 if q == 0 else 3})"],
    ),
    (
        "reduce_scatter shape",
        lambda c, r, p: c.reduce_scatter(torch.ones(p + r, 2)),
        lambda q, p: ["reduce_scatter(", f"shape=({p + q}, 2)"],
    ),
    (
        "alltoall dtype",
        lambda c, r, p: c.alltoall(_x(p, torch.int64 if r == 1 else torch.float32)),
        lambda q, p: ["alltoall(", "dtype=int64" if q == 1 else "dtype=float32"],
    ),
    (
        "gather root",
        lambda c, r, p: c.gather(_x(), root=r),
        lambda q, p: ["gather(", f"root={q}"],
    ),
    (
        "scatter root",
        lambda c, r, p: c.scatter(_x(p), root=r),
        lambda q, p: ["scatter(", f"root={q}"],
    ),
    (
        "barrier vs allreduce",
        lambda c, r, p: c.barrier() if r == p - 1 else c.allreduce(_x()),
        lambda q, p: ["barrier(" if q == p - 1 else "allreduce("],
    ),
    (
        "async",
        lambda c, r, p: c.allreduce_async(_x(2 + r), op="avg").wait(),
        lambda q, p: ["allreduce(", f"shape=({2 + q},)", "op=avg"],
    ),
    (
        "split ranks and color",
        lambda c, r, p: c.split(color=0) if r == 1 else c.split([0]),
        lambda q, p: ["split(color=0, key=0)" if q == 1 else "split(ranks=[0])"],
    ),
    (
        "split ranks",
        lambda c, r, p: c.split([0, 1] if r == 0 else [0, p - 1]),
        lambda q, p: ["split(ranks=" + ("[0, 1]" if q == 0 else f"[0, {p - 1}]")],
    ),
]


def _line(message: str, q: int) -> str:
    """Rank q's line of a CollectiveMismatchError message."""
    return next((s for s in message.splitlines() if s.strip().startswith(f"rank {q}:")), "")


def _in_step(comm: Communicator, i: int, failures: list[str], after: str) -> None:
    """The ranks are still in step: an allreduce (a different algorithm each time) works."""
    p, r = comm.size, comm.rank
    got = comm.allreduce(torch.full((5,), float(r)), algorithm=ALGOS[i % len(ALGOS)])
    if not torch.equal(got, torch.full((5,), float(p * (p - 1) // 2))):
        failures.append(f"allreduce after {after}: {got}")


def mismatches(comm: Communicator) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Run every mismatch on every rank, then the other calls that must keep the ranks in
    step: each section's failures on this rank, and the mismatch messages (identical on
    every rank)."""
    p, r = comm.size, comm.rank
    sections: dict[str, list[str]] = {}
    failures = sections["mismatches"] = []
    messages: dict[str, str] = {}
    for i, (name, call, pieces) in enumerate(MISMATCHES):
        try:
            call(comm, r, p)
            failures.append(f"{name}: no CollectiveMismatchError")
        except CollectiveMismatchError as e:
            messages[name] = str(e)
            if not isinstance(e, PlaitError) or len(e.calls) != p:
                failures.append(f"{name}: {type(e).__mro__} with calls {e.calls}")
            for q in range(p):
                line = _line(str(e), q)
                missing = [s for s in pieces(q, p) if s not in line]
                if missing:
                    failures.append(f"{name}: rank {q}'s line lacks {missing}:\n{e}")
        _in_step(comm, i, failures, name)

    # arguments every rank gets wrong raise before anything is sent: still in step
    failures = sections["invalid_op"] = []
    try:
        comm.allreduce(_x(), op="mean")
        failures.append("op='mean': no ValueError")
    except ValueError:
        pass
    _in_step(comm, 0, failures, "an invalid op")

    # PLAIT_CHECK=0 (set alike on every rank, here between two calls) skips the check, but
    # the exchanges that carry what a collective needs still catch a mismatch
    failures = sections["unchecked"] = []
    os.environ["PLAIT_CHECK"] = "0"
    try:
        for name, call, _ in MISMATCHES:
            if name in ("allgather trailing dims", "alltoall dtype", "gather root", "split ranks"):
                try:
                    call(comm, r, p)
                    failures.append(f"PLAIT_CHECK=0 {name}: no CollectiveMismatchError")
                except CollectiveMismatchError:
                    pass
        _in_step(comm, 2, failures, "PLAIT_CHECK=0 mismatches")
    finally:
        del os.environ["PLAIT_CHECK"]

    # shared memory asked for where it is turned off: ShmError on every rank, saying why
    failures = sections["shm_off"] = []
    saved = os.environ.get("PLAIT_SHM")
    os.environ["PLAIT_SHM"] = "0"
    try:
        shm_off = (ShmError, lambda: comm.allreduce(_x(), algorithm="shm"), ["off", "PLAIT_SHM=0"])
        failures += _expect_errors([shm_off], "shared memory off")
    finally:
        os.environ.pop("PLAIT_SHM")
        if saved is not None:
            os.environ["PLAIT_SHM"] = saved
    _in_step(comm, 3, failures, "shared memory off")

    sections["invalid_p2p"] = _invalid_p2p(comm)
    return sections, messages


def _invalid_p2p(comm: Communicator) -> list[str]:
    p, r = comm.size, comm.rank
    x = _x()
    cases: list[tuple[type[Exception], Callable[[], object], list[str]]] = [
        (ValueError, lambda: comm.send(x, r), ["another rank", f"[0, {p})", f"rank {r}"]),
        (ValueError, lambda: comm.isend(x, p), [f"[0, {p})", str(p)]),
        (ValueError, lambda: comm.recv(x, -1), [f"[0, {p})"]),
        (ValueError, lambda: comm.send(x, (r + 1) % p, tag=-1), ["tag", "4294967295"]),
        (ValueError, lambda: comm.irecv(x, (r + 1) % p, tag=2**32), ["tag", "4294967295"]),
        (ValueError, lambda: comm.irecv(torch.ones(2, 3).t(), (r + 1) % p), ["contiguous"]),
        (TypeError, lambda: comm.isend([1.0], (r + 1) % p), ["torch.Tensor", "list"]),
        (TypeError, lambda: comm.recv([1.0], (r + 1) % p), ["recv", "torch.Tensor", "list"]),
        (TypeError, lambda: comm.recv(x.to(torch.complex64), (r + 1) % p), ["float32"]),
    ]
    failures = _expect_errors(cases, "p2p")
    # a receive of the wrong size fails on the receiver, with both sizes
    sent = comm.isend(torch.ones(3), (r + 1) % p, tag=99)
    failures += _expect_errors(
        [(PlaitError, lambda: comm.recv(torch.empty(2), (r - 1) % p, tag=99), ["12", "8"])],
        "recv of the wrong size",
    )
    sent.wait()
    _in_step(comm, 1, failures, "a receive of the wrong size")
    return failures


def _expect_errors(
    cases: list[tuple[type[Exception], Callable[[], object], list[str]]], what: str
) -> list[str]:
    failures = []
    for i, (kind, call, pieces) in enumerate(cases):
        try:
            call()
            failures.append(f"{what} case {i}: no {kind.__name__} (wanted {pieces})")
        except kind as e:
            missing = [s for s in pieces if s not in str(e)]
            if missing:
                failures.append(f"{what} case {i}: {kind.__name__}({e!s}) lacks {missing}")
        except Exception as e:
            failures.append(f"{what} case {i}: {type(e).__name__}({e}) instead of {kind}")
    return failures


def invalid_arguments(comm: Communicator) -> None:
    """In a world of one: every check runs before any message, so one process is enough."""
    x = torch.ones(3)
    scalar = torch.tensor(1.0)
    dtypes = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
    ops = ["'sum'", "'avg'", "'min'", "'max'", "'prod'"]
    root = ["root", "[0, 1)"]
    E = list[tuple[type[Exception], Callable[[], object], list[str]]]
    cases: E = [
        (TypeError, lambda: comm.allreduce([1.0, 2.0]), ["torch.Tensor", "list"]),
        (TypeError, lambda: comm.allreduce(x.to(torch.complex64)), ["complex64", *dtypes]),
        (ValueError, lambda: comm.allreduce(x, op="mean"), ["'mean'", *ops]),
        (ValueError, lambda: comm.allreduce_(x, op="MAX"), ["'MAX'", *ops]),
        (
            ValueError,
            lambda: comm.allreduce(x, algorithm="butterfly"),
            ["'butterfly'", "'auto'", "'native'", "'ring'", "'halving_doubling'", "'tree'"],
        ),
        (ValueError, lambda: comm.allreduce_async(x, op="median"), ops),  # raised at once
        (TypeError, lambda: comm.allreduce_async_(3.0), ["torch.Tensor", "float"]),
        (ValueError, lambda: comm.allreduce_async_(x, algorithm="x"), ["'ring'"]),
        (ValueError, lambda: comm.broadcast(x, algorithm="ring"), ["'auto'", "'native'", "'tree'"]),
        (ValueError, lambda: comm.broadcast(x, root=1), [*root, "got 1"]),
        (ValueError, lambda: comm.broadcast_(x, root=-1), [*root, "-1"]),
        (ValueError, lambda: comm.broadcast(x, root=True), root),
        (TypeError, lambda: comm.broadcast_(x.to(torch.complex64)), dtypes),
        (ValueError, lambda: comm.reduce(x, root="0"), root),  # type: ignore[arg-type]
        (ValueError, lambda: comm.reduce(x, op="median"), ops),
        (ValueError, lambda: comm.reduce(x, algorithm="ring"), ["'tree'"]),
        (ValueError, lambda: comm.allgather(scalar), ["scalar"]),
        (ValueError, lambda: comm.allgather(x, algorithm="tree"), ["'ring'", "'native'"]),
        (TypeError, lambda: comm.allgather(x.to(torch.complex128)), dtypes),
        (ValueError, lambda: comm.reduce_scatter(scalar), ["scalar"]),
        (ValueError, lambda: comm.reduce_scatter(x, op="sub"), ops),
        (ValueError, lambda: comm.reduce_scatter(x, algorithm="tree"), ["'ring'"]),
        (ValueError, lambda: comm.alltoall(scalar), ["scalar"]),
        (ValueError, lambda: comm.alltoall(x, [1, 2]), ["splits", "dim 0 (3)", "[1, 2]"]),
        (ValueError, lambda: comm.alltoall(x, [4]), ["splits", "[4]"]),
        (ValueError, lambda: comm.alltoall(x, [-1]), ["non-negative", "[-1]"]),
        (ValueError, lambda: comm.alltoall(x, [3.0]), ["ints", "[3.0]"]),  # type: ignore[list-item]
        (TypeError, lambda: comm.alltoall(None), ["torch.Tensor"]),  # type: ignore[arg-type]
        (ValueError, lambda: comm.gather(x, root=2), [*root, "2"]),
        (ValueError, lambda: comm.gather(scalar), ["scalar"]),
        (ValueError, lambda: comm.scatter(x, root=1), root),
        (ValueError, lambda: comm.scatter(scalar), ["scalar"]),
        (TypeError, lambda: comm.scatter(None), ["torch.Tensor", "NoneType"]),
        (ValueError, lambda: comm.send(x, 0), ["another rank"]),
        (ValueError, lambda: comm.recv(x, 0), ["another rank"]),
        (ValueError, lambda: comm.split([1]), ["ranks", "[0, 1)", "[1]"]),
        (ValueError, lambda: comm.split([]), ["at least one"]),
        (ValueError, lambda: comm.split([0, 0]), ["distinct", "[0, 0]"]),
        (ValueError, lambda: comm.split([0], color=0), ["either ranks or color"]),
        (ValueError, lambda: comm.split(color=-1), ["color", "-1"]),
        (ValueError, lambda: comm.split(color="red"), ["color", "'red'"]),  # type: ignore[arg-type]
        (ValueError, lambda: comm.broadcast_object({}, root=1), root),
    ]
    failures = _expect_errors(cases, "world of one")
    # nothing above consumed a call: the world of one still works
    if not torch.equal(comm.allreduce(x, op="avg"), x):
        failures.append("allreduce after the invalid calls")
    if failures:
        raise AssertionError("\n".join(failures))


# ------------------------------------------------------------------------------ tests
Mismatches = list[tuple[dict[str, list[str]], dict[str, str]]]  # each rank's (failures, messages)


@pytest.fixture(scope="module")
def three_ranks() -> Mismatches:
    return run_world(3, mismatches, timeout=75, env={"PLAIT_TIMEOUT": "10"})


def _passed(ranks: Mismatches, section: str) -> None:
    failed = [
        f"rank {r}:\n" + "\n".join(f[section]) for r, (f, _) in enumerate(ranks) if f[section]
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.timeout(90)
def test_mismatch_raises_on_every_rank_and_keeps_ranks_in_step(three_ranks: Mismatches) -> None:
    _passed(three_ranks, "mismatches")
    messages = [m for _, m in three_ranks]
    assert set(messages[0]) == {name for name, _, _ in MISMATCHES}
    for name in messages[0]:
        assert messages[1][name] == messages[0][name] == messages[2][name], name


@pytest.mark.timeout(90)
def test_an_invalid_op_raises_before_anything_is_sent(three_ranks: Mismatches) -> None:
    _passed(three_ranks, "invalid_op")


@pytest.mark.timeout(90)
def test_without_the_check_the_exchanges_still_catch_a_mismatch(three_ranks: Mismatches) -> None:
    _passed(three_ranks, "unchecked")


@pytest.mark.timeout(90)
def test_shared_memory_turned_off_is_refused_on_every_rank(three_ranks: Mismatches) -> None:
    _passed(three_ranks, "shm_off")


@pytest.mark.timeout(90)
def test_invalid_point_to_point_calls_name_the_accepted_values(three_ranks: Mismatches) -> None:
    _passed(three_ranks, "invalid_p2p")


@pytest.mark.timeout(60)
def test_invalid_arguments_name_the_accepted_values() -> None:
    run_world(1, invalid_arguments, timeout=45)

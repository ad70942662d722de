"""The "plait" torch.distributed backend in worlds of real processes: every collective torch's
API reaches against gloo in the same processes (tests/support/torch_backend_checks.py), DDP
against DDP on gloo, the structure of its calls, one engine per process, init after
destroy, and a rank killed or frozen in the middle of DDP's backward."""

from __future__ import annotations

import copy
import itertools
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.support import torch_backend_checks as checks
from tests.support.world import WorldError, worlds_at_once
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

pytestmark = pytest.mark.timeout(240)

FAILURE_ENV = {"PLAIT_HEARTBEAT_TIMEOUT": "2"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
        self.spare = torch.nn.Linear(8, 2)  # used only when asked: find_unused_parameters

    def forward(self, x: torch.Tensor, spare: bool = False) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h) + (self.spare(h) if spare else 0)


def _everything(comm: Any) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "plait"
    gloo = dist.new_group(backend="gloo")
    checks.check_reductions(gloo, rank, size)
    checks.check_sparse(gloo, rank, size)
    checks.check_timeouts(gloo, rank, size)
    checks.check_movement(gloo, rank, size)
    checks.check_objects_and_p2p(gloo, rank, size)
    _check_first_call_checked(comm)
    _check_ddp(gloo, rank)
    _check_one_engine(comm)
    return {"group_name": dist.group.WORLD.group_name}


def _check_first_call_checked(comm: Any) -> None:
    """The mismatch check's record exchange runs on the first call of a kind only."""

    def sent() -> int:
        return sum(s for s, _ in comm.engine.counts().values())

    t = torch.ones(3, dtype=torch.int32)  # a kind no check before used
    counts = [sent()]
    for _ in range(3):
        dist.all_reduce(t)
        counts.append(sent())
    first, second, third = (b - a for a, b in itertools.pairwise(counts))
    assert first > second == third, counts


def _check_ddp(gloo: Any, rank: int) -> None:
    """DDP on the plait world group trains exactly as DDP on gloo: plain, with unused
    parameters, with comm hooks, and with no_sync."""
    cases: list[tuple[dict[str, Any], Any]] = [
        ({}, None),
        ({"find_unused_parameters": True}, None),
        ({}, default_hooks.allreduce_hook),
        ({}, default_hooks.fp16_compress_hook),
    ]
    for kwargs, hook in cases:
        torch.manual_seed(0)
        base = Net()
        trained = []
        for group in (dist.group.WORLD, gloo):
            model = DDP(copy.deepcopy(base), process_group=group, **kwargs)
            if hook is not None:
                model.register_comm_hook(group, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank * 10 + step))
                spare = step == 1 if kwargs else True  # unused in some steps: find_unused
                if step == 2:  # accumulate one micro-batch locally first
                    with model.no_sync():
                        model(x, spare).sum().backward()
                model(x, spare).sum().backward()
                opt.step()
                opt.zero_grad()
            trained.append(model.module.state_dict())
        # float16 sums (the compress hook) differ by summation order up to float16's epsilon
        tol = {"rtol": 2e-3, "atol": 2e-3} if hook is default_hooks.fp16_compress_hook else {}
        for name, value in trained[0].items():
            why = f"{kwargs} {hook} {name}"
            assert_close(value, trained[1][name], **tol, msg=lambda m, w=why: f"{w}: {m}")


def _check_one_engine(comm: Any) -> None:
    """plait.init() after init_process_group("plait") is the backend's engine: plait's own
    collectives and torch's run side by side on it."""
    import plait

    assert plait.init() is comm
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(comm.allreduce(t), t * dist.get_world_size())
    plait.shutdown()  # lets go of plait's hold only: the torch group still works
    dist.all_reduce(t)
    assert plait.is_initialized() and t[0] == dist.get_world_size() ** 2


def _init_again(comm: Any) -> list[Any]:
    """destroy_process_group then init_process_group("plait") in the same processes (torch
    keeps its store: plait's keys of the last engine must not mislead the next); the
    second init passes timeout= (plait's bound on a live peer), the third names plait for
    CPU tensors only ("cpu:plait,cuda:nccl"), the fourth joins through a file, with no
    MASTER_ADDR/MASTER_PORT set (as torch's own test suite does)."""
    import plait
    from plait import env

    got: list[Any] = [env.get("PLAIT_TIMEOUT")]  # what holds where torch's default was left
    rank, size = dist.get_rank(), dist.get_world_size()
    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    inits: list[dict[str, Any]] = [
        {"timeout": timedelta(seconds=77)},
        {"backend": "cpu:plait,cuda:nccl"},
        {"init_method": f"file://{where[0]}/store", "rank": rank, "world_size": size},
        {},
    ]
    for kwargs in inits:
        t = torch.tensor([float(dist.get_rank() + len(got) - 1)])
        dist.all_reduce(t)
        got.append((t.item(), plait.default().engine.timeout, dist.get_backend()))
        dist.destroy_process_group()
        assert not plait.is_initialized()
        master = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        if "init_method" not in kwargs:
            os.environ.update(master)  # env:// (the default) reads them
        dist.init_process_group(kwargs.pop("backend", "plait"), **kwargs)
        os.environ.update(master)
    return got


def _dies(comm: Any, where: str, how: int) -> tuple[str, str, float, str] | None:
    """Rank 1 is killed (or frozen) at step 2: inside DDP's backward (`where="ddp"`),
    inside FSDP2's forward between its units' all-gathers ("fsdp"), or in the forward of
    the second stage of a 2-stage GPipe pipeline while stage 0 waits for its gradients
    ("pipeline"). The others report what their step raised, how long that step took, and
    what a dist.* call raises next."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    step = [0]

    def maybe_die(*_: Any) -> None:
        if rank == 1 and step[0] == 2:
            os.kill(os.getpid(), how)

    one_step = _stepper(where, rank, maybe_die)
    started = 0.0
    try:
        for step[0] in range(6):
            started = time.monotonic()
            one_step()
    except Exception as e:  # what the survivor saw
        took = time.monotonic() - started
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as after:
            return type(e).__name__, str(e), took, type(after).__name__
        return type(e).__name__, str(e), took, "nothing"
    return None


def _stepper(where: str, rank: int, maybe_die: Any) -> Any:
    """One training step of `where`'s kind, with `maybe_die` hooked where rank 1 dies."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    x = torch.randn(8, 4)
    if where == "pipeline":
        part = torch.nn.Linear(4, 4)
        part.register_forward_pre_hook(maybe_die)
        run = ScheduleGPipe(PipelineStage(part, rank, 2, torch.device("cpu")), 4,
                            loss_fn=lambda out, y: ((out - y) ** 2).mean())  # fmt: skip
        return lambda: run.step(x) if rank == 0 else run.step(target=x)
    model: torch.nn.Module
    if where == "ddp":
        model = DDP(Net())
        model.module.a.weight.register_hook(maybe_die)
    else:
        model = Net()
        for unit in (model.a, model.b, model):
            fully_shard(unit)
        model.b.register_forward_pre_hook(maybe_die)
    return lambda: model(x, True).sum().backward()


@pytest.fixture(scope="module")
def worlds() -> Iterator[dict[str, Any]]:
    torch_init = {"init": "torch:plait"}
    failing = {**torch_init, "tolerate": [1], "env": FAILURE_ENV, "timeout": 60}
    with worlds_at_once(
        {
            "ops3": (3, _everything, (), torch_init),
            "ops4": (4, _everything, (), torch_init),
            "again": (2, _init_again, (), torch_init),
            "kill": (3, _dies, ("ddp", signal.SIGKILL), failing),
            "stop": (3, _dies, ("ddp", signal.SIGSTOP), failing),
            "fsdp-kill": (3, _dies, ("fsdp", signal.SIGKILL), failing),
            "fsdp-stop": (3, _dies, ("fsdp", signal.SIGSTOP), failing),
            "pipeline-kill": (2, _dies, ("pipeline", signal.SIGKILL), failing),
            "pipeline-stop": (2, _dies, ("pipeline", signal.SIGSTOP), failing),
        }
    ) as futures:
        yield futures


@pytest.mark.parametrize("world", ["ops3", "ops4"])
def test_collectives_ddp_and_structure_match_gloo(worlds: dict[str, Any], world: str) -> None:
    results = worlds[world].result()
    assert [r["group_name"] for r in results] == ["0"] * len(results)


def test_init_after_destroy(worlds: dict[str, Any]) -> None:
    default, *rounds = worlds["again"].result()[0]
    want = [
        (1.0, default, "plait"),
        (3.0, 77.0, "plait"),
        (5.0, default, "cpu:plait,cuda:nccl"),
        (7.0, default, "plait"),
    ]
    assert rounds == want and worlds["again"].result()[1] == [default, *want]


@pytest.mark.parametrize(
    "how", ["kill", "stop", "fsdp-kill", "fsdp-stop", "pipeline-kill", "pipeline-stop"]
)
def test_a_lost_rank_is_named_on_every_survivor_in_ddp_fsdp2_and_pipelining(
    worlds: dict[str, Any], how: str
) -> None:
    try:
        results = worlds[how].result()
    except WorldError as e:
        pytest.fail(f"the world did not end cleanly: {e}")
    for rank in (0,) if how.startswith("pipeline") else (0, 2):
        assert results[rank] is not None, f"rank {rank}'s step did not raise"
        kind, message, seconds, then = results[rank]
        # DDP's wait runs in C++, which wraps it in a RuntimeError; FSDP2's and the
        # pipeline's in Python, which lets plait's own type through
        assert "rank 1 failed" in message, message
        assert kind == ("RuntimeError" if how in ("kill", "stop") else "PeerFailureError"), kind
        assert seconds < 15, (seconds, message)
        assert then == "PeerFailureError", then

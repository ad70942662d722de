"""plait.horovod.torch on CUDA tensors, in worlds of 2 ranks that may share one GPU.

Marked `cuda`: skipped where no GPU is visible (tests/conftest.py). Every world runs once per
way CUDA tensors travel (PLAIT_CUDA_TRANSPORT): "nccl", skipped with the reason where NCCL
cannot join two ranks on this machine's GPUs (two ranks on one GPU need NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1), and "staged" (through host memory), which runs wherever a GPU
does. Each rank computes the expected values on the CPU, as tests/world/test_horovod.py does,
and every result must also be on its input's device. The usual Horovod script on GPUs is in
tests/e2e/test_horovod_cuda_script.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait import Communicator
from support.cuda import RANKS, world_env
from support.horovod_checks import (
    Checks,
    assert_section,
    data,
    join_in_training,
    make_batch,
    make_model,
    mse,
    same_params,
)
from support.world import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240)]
TRANSPORTS = ["nccl", "staged"]


def same(
    ck: Checks, name: str, got: Any, want: torch.Tensor, dev: torch.device, tol: float = 0
) -> None:
    """`got` is on `dev` and equals (or, with `tol`, is close to) the CPU tensor `want`."""
    if not isinstance(got, torch.Tensor):
        ck.fail(f"{name}: got a {type(got).__name__}, not a tensor")
        return
    ck.equal(f"{name}: device", got.device, dev)
    if tol:
        ck.close(name, got.cpu(), want, rtol=tol, atol=tol)
    else:
        ck.equal(name, got.cpu(), want)


# ------------------------------------------------------------------------ collectives
def check_collectives(hvd: Any, ck: Checks, dev: torch.device) -> None:
    n, r = hvd.size(), hvd.rank()
    ck.equal("cuda_built", hvd.cuda_built(), torch.version.cuda is not None)
    ck.equal("nccl_built", bool(hvd.nccl_built()), torch.distributed.is_nccl_available())

    for dtype in (torch.float32, torch.int64):
        xs = [data((4, 3), 1, q, dtype) for q in range(n)]
        stack, x = torch.stack(xs), xs[r].to(dev)
        same(ck, f"Sum {dtype}", hvd.allreduce(x, op=hvd.Sum), stack.sum(0), dev)
        same(ck, f"Min {dtype}", hvd.allreduce(x, op=hvd.Min), stack.amin(0), dev)
        same(ck, f"Max {dtype}", hvd.allreduce(x, op=hvd.Max), stack.amax(0), dev)
        same(ck, f"Product {dtype}", hvd.allreduce(x, op=hvd.Product), stack.prod(0), dev)
        got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
        same(ck, f"Sum pre*post {dtype}", got, stack.sum(0) * 6, dev)
        same(ck, f"input unchanged {dtype}", x, xs[r], dev)
    xs = [data((5,), 2, q) for q in range(n)]
    same(ck, "Average", hvd.allreduce(xs[r].to(dev)), torch.stack(xs).mean(0), dev, 1e-6)
    got = hvd.allreduce(xs[r].to(dev), op=hvd.Sum, compression=hvd.Compression.fp16)
    same(ck, "fp16 compression", got, torch.stack(xs).sum(0), dev, 1e-3)

    # in place (a transposed view too), async, poll and synchronize
    xs = [data((3, 2), 4, q) for q in range(n)]
    y = xs[r].to(dev, copy=True)
    ck.true("allreduce_ returns its argument", hvd.allreduce_(y, op=hvd.Sum) is y)
    same(ck, "allreduce_", y, torch.stack(xs).sum(0), dev)
    view = xs[r].to(dev, copy=True).t()
    hvd.allreduce_(view, op=hvd.Max)
    same(ck, "allreduce_ on a transposed view", view, torch.stack(xs).amax(0).t(), dev)
    y = xs[r].to(dev, copy=True)
    h1 = hvd.allreduce_async(xs[r].to(dev), op=hvd.Sum, postscale_factor=0.5)
    h2 = hvd.allreduce_async_(y, op=hvd.Min)
    h3 = hvd.allgather_async(xs[r].to(dev))
    same(ck, "async gather", hvd.synchronize(h3), torch.cat(xs), dev)
    same(ck, "async allreduce", hvd.synchronize(h1), torch.stack(xs).sum(0) * 0.5, dev)
    ck.true("async in place returns the tensor", hvd.synchronize(h2) is y)
    same(ck, "async in place", y, torch.stack(xs).amin(0), dev)

    if dev.type == "cuda":
        check_stream_order(hvd, ck, dev)

    # grouped: one buffer per dtype and device (a CPU tensor in the group stays on the CPU)
    a = [data((2, 2), 5, q) for q in range(n)]
    b = [data((3,), 6, q, torch.int64) for q in range(n)]
    c = [data((1,), 7, q) for q in range(n)]
    want = [torch.stack(v).sum(0) for v in (a, b, c)]
    got = hvd.grouped_allreduce([a[r].to(dev), b[r].to(dev), c[r]], op=hvd.Sum)
    same(ck, "grouped 0", got[0], want[0], dev)
    same(ck, "grouped 1", got[1], want[1], dev)
    same(ck, "grouped, the CPU tensor", got[2], want[2], torch.device("cpu"))
    mine = [a[r].to(dev, copy=True), b[r].to(dev, copy=True)]
    hvd.grouped_allreduce_(mine, op=hvd.Sum)
    same(ck, "grouped_allreduce_", mine[1], want[1], dev)
    got = hvd.synchronize(hvd.grouped_allreduce_async([a[r].to(dev), c[r].to(dev)], op=hvd.Sum))
    same(ck, "grouped async", got[1], want[2], dev)

    # allgather with a different dim 0 per rank (rank 0 sends none)
    parts = [torch.full((q, 2), float(q)) for q in range(n)]
    same(ck, "allgather uneven", hvd.allgather(parts[r].to(dev)), torch.cat(parts), dev)
    h = hvd.grouped_allgather_async([parts[r].to(dev), parts[r].long().to(dev)])
    same(ck, "grouped_allgather_async", hvd.synchronize(h)[1], torch.cat(parts).long(), dev)

    for root in range(n):
        xs = [data((2, 3), 8 + root, q) for q in range(n)]
        same(ck, f"broadcast {root}", hvd.broadcast(xs[r].to(dev), root), xs[root], dev)
        y = xs[r].to(dev, copy=True)
        hvd.broadcast_(y, root_rank=root)
        same(ck, f"broadcast_ {root}", y, xs[root], dev)
        got = hvd.synchronize(hvd.broadcast_async(xs[r].to(dev), root))
        same(ck, f"broadcast_async {root}", got, xs[root], dev)

    # alltoall: rank r sends q+1 rows to rank q, each row holding (sender, receiver); the
    # received splits are where Horovod puts them: the CPU for a list, else the splits' device
    splits = [q + 1 for q in range(n)]
    rows = torch.tensor([[r, q] for q in range(n) for _ in range(q + 1)], dtype=torch.float32)
    want = torch.tensor([[q, r] for q in range(n) for _ in range(r + 1)], dtype=torch.float32)
    out, received = hvd.alltoall(rows.to(dev), splits=splits)
    same(ck, "alltoall", out, want, dev)
    ck.equal(
        "alltoall splits of a list, on the CPU",
        received,
        torch.full((n,), r + 1, dtype=torch.int32),
    )
    tensor_splits = torch.tensor(splits, dtype=torch.int32, device=dev)
    out, received = hvd.synchronize(hvd.alltoall_async(rows.to(dev), tensor_splits))
    same(ck, "alltoall_async", out, want, dev)
    ck.equal("alltoall splits of a CUDA tensor: there", received.device, dev)

    xs = [data((2 * n + 1, 2), 9, q) for q in range(n)]
    mine_rows = torch.stack(xs).sum(0).tensor_split(n)[r]
    same(ck, "reducescatter Sum", hvd.reducescatter(xs[r].to(dev), op=hvd.Sum), mine_rows, dev)
    same(ck, "reducescatter Average", hvd.reducescatter(xs[r].to(dev)), mine_rows / n, dev, 1e-6)
    got = hvd.grouped_reducescatter([xs[r].to(dev)], op=hvd.Sum)
    same(ck, "grouped_reducescatter", got[0], mine_rows, dev)
    hvd.barrier()


def check_stream_order(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """The input is still being computed on the GPU when the call is made."""
    n, r = hvd.size(), hvd.rank()
    a = torch.ones(512, 512, device=dev)
    h = hvd.allreduce_async(a @ a, op=hvd.Sum)  # every entry 512 once the matmul has run
    same(ck, "after a queued matmul", hvd.synchronize(h), torch.full((512, 512), 512.0 * n), dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # issued on a side stream, synchronized on the default one
        h = hvd.allreduce_async((a @ a) * (r + 1), op=hvd.Sum)
    want = torch.full((512, 512), 512.0 * n * (n + 1) / 2)
    same(ck, "issued on a side stream", hvd.synchronize(h), want, dev)


def check_gradients(hvd: Any, ck: Checks, dev: torch.device) -> None:
    n, r = hvd.size(), hvd.rank()
    x = torch.ones(4, device=dev, requires_grad=True)
    hvd.allreduce(x * 2, op=hvd.Sum).backward(torch.ones(4, device=dev))
    same(ck, "allreduce grad", x.grad, torch.full((4,), 2.0 * n), dev)
    sizes = [q + 1 for q in range(n)]
    x = torch.zeros(sizes[r], 3, device=dev, requires_grad=True)
    grad = torch.cat([torch.full((s, 3), float(q)) for q, s in enumerate(sizes)])
    hvd.allgather(x).backward(grad.to(dev))
    same(ck, "allgather grad", x.grad, torch.full((sizes[r], 3), float(r)), dev)
    for root in range(n):
        x = torch.ones(3, device=dev, requires_grad=True)
        hvd.broadcast(x, root).backward(torch.full((3,), float(r), device=dev))
        want = (n - 1) / 2 if r == root else 0.0
        same(ck, f"broadcast grad {root}", x.grad, torch.full((3,), want), dev, 1e-6)
    x = torch.ones(2 * n, 2, device=dev, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).backward(torch.ones(2, 2, device=dev))
    same(ck, "reducescatter grad", x.grad, torch.full((2 * n, 2), float(n)), dev)
    x = torch.zeros(sum(sizes), device=dev, requires_grad=True)
    out, _ = hvd.alltoall(x, splits=sizes)
    out.backward(torch.arange(out.numel(), dtype=torch.float32, device=dev) + 100 * r)
    want = torch.cat([
        torch.arange(r * (q + 1), (r + 1) * (q + 1), dtype=torch.float32) + 100 * q
        for q in range(n)
    ])  # fmt: skip
    same(ck, "alltoall grad", x.grad, want, dev)


# -------------------------------------------------------------------------- training
def check_training(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """N ranks on CUDA with batch b end where one process with batch N*b ends (float64)."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    for name, make, extra in (
        ("SGD momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),
        ("Adam, 2 groups", lambda ps: torch.optim.Adam(ps, lr=0.01), {"groups": 2}),
    ):
        ref, model = make_model().to(dev), make_model(seed=r).to(dev)  # ranks start apart
        ref_opt = make(ref.parameters())
        opt = hvd.DistributedOptimizer(
            make(model.parameters()), named_parameters=model.named_parameters(), **extra
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        # broadcast_optimizer_state creates the state as Horovod does, with one step on zero
        # gradients (Adam counts it: its bias correction starts at step 2); so does the
        # reference, or Adam's first three updates would differ by ~lr/4 each
        for p in ref.parameters():
            p.grad = torch.zeros_like(p)
        ref_opt.step()
        for step in range(3):
            x, y = (t.to(dev) for t in make_batch(step, n, b))
            ref_opt.zero_grad()
            mse(ref, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            mse(model, x[mine], y[mine]).backward()
            opt.step()
        same_params(ck, f"{name} on {dev}", model, ref)
        ck.true(
            f"{name}: parameters stay on {dev}", all(p.device == dev for p in model.parameters())
        )

    # broadcast_optimizer_state where only the root has state: the others allocate it where
    # the root keeps it (moments beside the CUDA parameters, Adam's step on the CPU)
    model = make_model().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:
        x, y = (t.to(dev) for t in make_batch(0, n, b))
        mse(model, x, y).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()["state"]
    ck.equal("optimizer state for every parameter", len(state), 4)
    for pid, entries in state.items():
        ck.equal(f"exp_avg {pid} beside its parameter", entries["exp_avg"].device, dev)
    mine = {
        pid: ({k: v.device.type for k, v in e.items()}, e["exp_avg"].cpu().tolist())
        for pid, e in state.items()
    }
    everyone = hvd.allgather_object(mine)
    ck.true(
        "every rank has the root's state, where it has it", all(e == everyone[0] for e in everyone)
    )
    ck.equal("lr", opt.param_groups[0]["lr"], 0.01)

    # a state_dict with buffers (an int64 one too) on the GPU
    torch.manual_seed(r)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(dev)
    net[1].num_batches_tracked += r
    hvd.broadcast_parameters(net.state_dict(), root_rank=n - 1)
    sd = {k: v.cpu() for k, v in net.state_dict().items()}
    everyone = hvd.allgather_object(sd)
    for k in sd:
        ck.true(
            f"broadcast_parameters {k}", all(torch.equal(e[k], everyone[-1][k]) for e in everyone)
        )
        ck.equal(f"broadcast_parameters {k} device", net.state_dict()[k].device, dev)


# ------------------------------------------------------------------------------ join
def check_join(hvd: Any, ck: Checks, dev: torch.device) -> None:
    n, r = hvd.size(), hvd.rank()
    # the joined rank serves CUDA calls with CUDA stand-ins (default: its current GPU; then
    # the GPU named by hvd.join's device)
    gpu = dev.index if dev.type == "cuda" else -1
    for first, device in ((0, -1), (n - 1, gpu)):
        a = data((5,), 20, 0).to(dev)
        if r == first:
            last = hvd.join(device)
        else:
            ha = hvd.allreduce_async(a, op=hvd.Average)
            same(
                ck,
                f"join first={first}: Average",
                hvd.synchronize(ha),
                a.cpu() * (n - 1) / n,
                dev,
                1e-6,
            )
            same(
                ck,
                f"join first={first}: Max ignores the joined rank",
                hvd.allreduce(torch.tensor([-5.0 - r], device=dev), op=hvd.Max),
                torch.tensor([max(-5.0 - q for q in range(n) if q != first)]),
                dev,
            )
            ck.raises(  # refused as in Horovod; the joined rank stays joined
                f"join first={first}: allgather refused",
                hvd.HorovodInternalError,
                lambda: hvd.allgather(torch.full((1, 2), float(r), device=dev)),
                "not supported with Join",
            )
            last = hvd.join()
        ck.true(f"join first={first}: last is not the first", last != first)

    join_in_training(hvd, ck, n, r, str(dev))  # uneven data on the GPU, then join


# ------------------------------------------------------------------------------ tests
SECTIONS = {
    "collectives": check_collectives,
    "gradients": check_gradients,
    "training": check_training,
    "join": check_join,
}


def cuda_battery(comm: Communicator) -> dict[str, list[str]]:
    """Every section in one world: each section's failed checks on this rank."""
    import plait.horovod.torch as hvd

    ck = Checks()
    hvd.init()
    # the usual script's line; modulo the GPU count because the ranks may share one GPU
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    ck.run(hvd, SECTIONS, dev)
    hvd.shutdown()
    return ck.failures


@pytest.fixture(scope="module", params=TRANSPORTS)
def world(request: pytest.FixtureRequest) -> list[dict[str, list[str]]]:
    return run_world(RANKS, cuda_battery, timeout=220, env=world_env(request.param))


def test_every_collective_on_cuda_tensors(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "collectives")


def test_the_gradient_of_every_collective_on_cuda(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "gradients")


def test_training_on_cuda_ends_where_one_process_ends(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "training")


def test_join_on_cuda(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "join")

"""hvd.SyncBatchNorm against one process's torch.nn.BatchNorm on the global batch.

Each rank builds the global batch itself (every rank's samples, a different number per
rank), runs the reference on all of it, and its SyncBatchNorm on its own rows: outputs,
input gradients, weight/bias gradients summed over ranks and running statistics must
match. One world per size runs the whole battery (a world costs seconds); size 1 checks the
plain batch-norm path. Two more worlds, marked `cuda`, run the same sections on GPU tensors.
Each test asserts one section on every rank of every world.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from support.horovod_checks import Checks, assert_section
from support.world import run_world, worlds_at_once

f64, f32 = torch.float64, torch.float32
TOL = {f64: 1e-10, f32: 2e-5}
# input tail (C, *) per kind of batch norm: (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W)
SHAPES = {"1d (N,C)": (3,), "1d (N,C,L)": (3, 5), "2d": (4, 3, 2), "3d": (2, 3, 2, 2)}
REFERENCE = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}


def reference_bn(dim: int, c: int, **kw: Any) -> torch.nn.Module:
    return REFERENCE.get(dim, torch.nn.BatchNorm3d)(c, **kw)


def rows(sizes: list[int], r: int) -> slice:
    """Rank r's rows of the global batch, where rank q holds sizes[q] samples."""
    return slice(sum(sizes[:r]), sum(sizes[: r + 1]))


def global_batch(
    seed: int, n: int, tail: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy) for n samples, the same on every rank; x is off-centre (mean 5, std 3) so a
    variance computed as E[x^2] - E[x]^2 in float32 would lose digits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *tail, generator=g, dtype=f64) * 3 + 5
    dy = torch.randn(n, *tail, generator=g, dtype=f64)
    return x.to(dtype), dy.to(dtype)


def set_affine(bn: torch.nn.Module, seed: int) -> None:
    if bn.weight is None:
        return
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(bn.weight.shape, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(bn.bias.shape, generator=g))


def compare_steps(
    hvd: Any,
    ck: Checks,
    dev: torch.device,
    name: str,
    tail: tuple[int, ...],
    sizes: list[int],
    dtype: torch.dtype,
    steps: int = 3,
    **kw: Any,
) -> None:
    """`steps` training steps of hvd.SyncBatchNorm (this rank's rows, on `dev`) and one
    process's BatchNorm (the global batch, on the CPU), then one eval step; all must match."""
    r, tol = hvd.rank(), TOL[dtype]
    mine = rows(sizes, r)
    ref = reference_bn(len(tail) + 1, tail[0], **kw).to(dtype)
    bn = hvd.SyncBatchNorm(tail[0], **kw).to(dtype)
    set_affine(ref, 1)
    set_affine(bn, 1)
    bn.to(dev)
    close = lambda what, got, want: ck.close(  # noqa: E731
        f"{name}: {what}", got.detach().cpu(), want.detach(), rtol=tol, atol=tol
    )
    for step in range(steps):
        x, dy = global_batch(10 * step + len(tail), sum(sizes), tail, dtype)
        xg = x.clone().requires_grad_()
        want = ref(xg)
        want.backward(dy)
        xr = x[mine].to(dev).requires_grad_()
        got = bn(xr)
        got.backward(dy[mine].to(dev))
        ck.true(f"{name}: output on {dev}", got.device == xr.device and got.dtype == dtype)
        ck.true(f"{name}: finite output, step {step}", bool(torch.isfinite(got).all()))
        close(f"output, step {step}", got, want[mine])
        close(f"input gradient, step {step}", xr.grad, xg.grad[mine])
        if ref.weight is not None:
            # local gradients, summed over ranks here (DistributedOptimizer would average)
            close("weight gradient", hvd.allreduce(bn.weight.grad, op=hvd.Sum), ref.weight.grad)
            close("bias gradient", hvd.allreduce(bn.bias.grad, op=hvd.Sum), ref.bias.grad)
        if ref.running_mean is not None:
            close(f"running_mean, step {step}", bn.running_mean, ref.running_mean)
            close(f"running_var, step {step}", bn.running_var, ref.running_var)
            ck.equal(f"{name}: num_batches_tracked", int(bn.num_batches_tracked), step + 1)
    ref.eval()
    bn.eval()
    x, _ = global_batch(99, sum(sizes), tail, dtype)
    with torch.no_grad():
        close("eval output", bn(x[mine].to(dev)), ref(x)[mine])


def check_equivalence(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """Every kind of input, uneven batches, both dtypes, the constructor's options."""
    n = hvd.size()
    uneven = [2 + 3 * q for q in range(n)]  # 2, 5, 8 samples
    for dtype in (f64, f32):
        for kind, tail in SHAPES.items():
            compare_steps(hvd, ck, dev, f"{kind} {dtype}", tail, uneven, dtype)
    compare_steps(hvd, ck, dev, "momentum=None", (3, 4), uneven, f64, momentum=None)
    compare_steps(hvd, ck, dev, "affine=False", (3,), uneven, f64, affine=False)
    compare_steps(hvd, ck, dev, "eps, momentum", (3,), uneven, f32, eps=1e-3, momentum=0.5)
    # without running statistics eval mode normalizes with the global batch's, as Horovod's
    compare_steps(hvd, ck, dev, "no running stats", (3, 2), uneven, f64, track_running_stats=False)
    if n > 1:  # a rank with no samples: the others' statistics, no NaN anywhere
        empty = [0 if q == n - 1 else 3 for q in range(n)]
        compare_steps(hvd, ck, dev, "an empty rank", (3, 2), empty, f64)
        compare_steps(hvd, ck, dev, "an empty rank, 2d", (4, 2, 3), empty, f32)


def check_errors(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """Errors every rank raises together (no one is left waiting in a collective)."""
    n, r = hvd.size(), hvd.rank()
    bn = hvd.SyncBatchNorm(3).to(dev)
    ck.raises("1D input", ValueError, lambda: bn(torch.zeros(3, device=dev)), "at least 2 dims")
    ck.raises("channels", ValueError, lambda: bn(torch.zeros(4, 5, device=dev)), "3 channels")
    # one sample in the whole job: no variance to take (torch's BatchNorm refuses it too)
    one = torch.zeros(1 if r == 0 else 0, 3, device=dev)
    ck.raises("1 value", ValueError, lambda: bn(one), "more than 1 value per channel")
    if n > 1:  # the same, when each rank alone has too few but all together do not
        bn.train()
        x = torch.arange(3.0, device=dev).view(1, 3) + r
        ck.true("1 sample per rank is fine", bool(torch.isfinite(bn(x)).all()))


def check_collectives_per_call(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """Training: 1 allgather forward, 1 allreduce backward; none in eval mode or at size 1."""
    import plait.horovod.torch.sync_batch_norm as mod

    calls: list[str] = []
    real = {"allgather": mod.allgather, "allreduce": mod.allreduce}

    def counted(what: str) -> Any:
        return lambda *a, **k: (calls.append(what), real[what](*a, **k))[1]

    mod.allgather, mod.allreduce = counted("allgather"), counted("allreduce")  # type: ignore[assignment]
    try:
        bn = hvd.SyncBatchNorm(3).to(dev)
        x = torch.randn(4, 3, 2, device=dev, requires_grad=True)
        y = bn(x)
        forward = list(calls)
        y.sum().backward()
        backward = calls[len(forward) :]
        bn.eval()
        before = len(calls)
        bn(x).sum().backward()
        in_eval = calls[before:]
    finally:
        mod.allgather, mod.allreduce = real["allgather"], real["allreduce"]  # type: ignore[assignment]
    synced = hvd.size() > 1
    ck.equal("forward collectives", forward, ["allgather"] if synced else [])
    ck.equal("backward collectives", backward, ["allreduce"] if synced else [])
    ck.equal("eval collectives", in_eval, [])


def check_training(hvd: Any, ck: Checks, dev: torch.device) -> None:
    """A model with SyncBatchNorm, hvd.DistributedOptimizer, 4 samples per rank, ends where
    one process with BatchNorm1d and the whole batch ends (float64, SGD with momentum)."""
    n, r, b = hvd.size(), hvd.rank(), 4

    def model(bn: type[torch.nn.Module]) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 8), bn(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
        return torch.nn.Sequential(*layers).double()

    ref, mine = model(torch.nn.BatchNorm1d), model(hvd.SyncBatchNorm)
    mine.load_state_dict(ref.state_dict())  # the same names: a drop-in replacement
    mine.to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9),
        named_parameters=mine.named_parameters(),
    )
    for step in range(3):
        g = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(n * b, 6, generator=g, dtype=f64), torch.randn(n * b, 3, generator=g)
        y = y.double()
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        part = slice(r * b, (r + 1) * b)
        opt.zero_grad()
        ((mine(x[part].to(dev)) - y[part].to(dev)) ** 2).mean().backward()
        opt.step()
    for (pn, p), q in zip(mine.state_dict().items(), ref.state_dict().values(), strict=True):
        if p.is_floating_point():
            ck.close(f"trained {pn}", p.cpu(), q, rtol=1e-10, atol=1e-10)
        else:
            ck.equal(f"trained {pn}", p.cpu(), q)


SECTIONS = {
    "equivalence": check_equivalence,
    "errors": check_errors,
    "collectives_per_call": check_collectives_per_call,
    "training": check_training,
}


def battery(comm: Any, device: str) -> dict[str, list[str]]:
    """Every section in one world: each section's failed checks on this rank."""
    import plait.horovod.torch as hvd

    ck = Checks()
    hvd.init()
    if device == "cuda":  # ranks may share one GPU
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    ck.run(hvd, SECTIONS, dev)
    hvd.shutdown()
    return ck.failures


# one world per id: CPU worlds of 1-3 ranks; 2 ranks on GPUs, per way CUDA tensors travel
WORLDS = [
    pytest.param("cpu-1", marks=pytest.mark.timeout(120)),
    pytest.param("cpu-2", marks=pytest.mark.timeout(120)),
    pytest.param("cpu-3", marks=pytest.mark.timeout(120)),
    pytest.param("cuda-nccl", marks=[pytest.mark.cuda, pytest.mark.timeout(240)]),
    pytest.param("cuda-staged", marks=[pytest.mark.cuda, pytest.mark.timeout(240)]),
]


Failures = dict[str, list[str]]  # one rank's failed checks by section
CPU_SIZES = [1, 2, 3]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[list[Failures]]]]:
    """The CPU worlds, started at once (their ranks mostly wait for each other's messages)."""
    env = {"PLAIT_TIMEOUT": "20"}
    calls = {n: (n, battery, ("cpu",), {"timeout": 100, "env": env}) for n in CPU_SIZES}
    with worlds_at_once(calls) as worlds:
        yield worlds


@pytest.fixture(scope="module", params=WORLDS)
def world(request: pytest.FixtureRequest) -> list[Failures]:
    device, _, how = request.param.partition("-")
    if device == "cpu":  # (the CPU worlds start with the first that is asked for)
        started: dict[int, Future[list[Failures]]] = request.getfixturevalue("started")
        return started[int(how)].result()
    from support.cuda import world_env

    return run_world(2, battery, "cuda", timeout=220, env=world_env(how))


def test_every_kind_of_input_matches_one_process(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "equivalence")


def test_errors_are_raised_on_every_rank_together(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "errors")


def test_one_allgather_forward_and_one_allreduce_backward(
    world: list[dict[str, list[str]]],
) -> None:
    assert_section(world, "collectives_per_call")


def test_training_ends_where_one_process_ends(world: list[dict[str, list[str]]]) -> None:
    assert_section(world, "training")

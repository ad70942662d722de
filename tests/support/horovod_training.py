"""plait.horovod.torch's training checked on one rank of a world: DistributedOptimizer against
one process that sees the whole batch (float64, tight tolerance), the broadcasts of
parameters and optimizer state, and join. Each `check_X` is one section of
tests/world/test_horovod.py's battery.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from support.horovod_checks import (
    Checks,
    data,
    f64,
    join_in_training,
    make_batch,
    make_model,
    mse,
    same_params,
)


def sgd(ps: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)


def adam(ps: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=0.01)


def check_optimizer(hvd: Any, ck: Checks) -> None:
    """N ranks with batch b end where one process with batch N*b ends (float64), for each
    optimizer and option."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    cases: list[tuple[str, Any, Callable[[torch.nn.Module], dict[str, Any]], float, float]] = [
        ("SGD momentum", sgd, lambda m: {}, 1.0, 1e-10),
        ("Adam", adam, lambda m: {}, 1.0, 1e-10),
        (
            "Adam, 2 groups, predivide 2",
            adam,
            lambda m: {"groups": 2, "gradient_predivide_factor": 2.0},
            1.0,
            1e-10,
        ),
        (
            "SGD, a group per parameter",
            sgd,
            lambda m: {"groups": [[p] for p in m.parameters()]},
            1.0,
            1e-10,
        ),
        ("SGD, op=Sum", sgd, lambda m: {"op": hvd.Sum}, float(n), 1e-10),
        ("SGD, fp16", sgd, lambda m: {"compression": hvd.Compression.fp16}, 1.0, 2e-3),
    ]
    for name, make, extra, scale, tol in cases:
        ref, model = make_model(), make_model()
        ref_opt = make(ref.parameters())
        opt = hvd.DistributedOptimizer(
            make(model.parameters()), named_parameters=model.named_parameters(), **extra(model)
        )
        ck.true(
            f"{name}: isinstance",
            isinstance(opt, type(ref_opt)) and type(opt).__name__ == type(ref_opt).__name__,
        )
        for step in range(3):
            x, y = make_batch(step, n, b)
            ref_opt.zero_grad()
            (mse(ref, x, y) * scale).backward()
            ref_opt.step()
            opt.zero_grad()
            mse(model, x[mine], y[mine]).backward()
            opt.step()
        same_params(ck, name, model, ref, tol)
        ck.equal(
            f"{name}: state_dict keys",
            set(opt.state_dict()["state"]),
            set(ref_opt.state_dict()["state"]),
        )


def check_overlap(hvd: Any, ck: Checks) -> None:
    """Buckets start during backward, in bucket order (the overlap)."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=3)
    x, y = make_batch(0, n, b)
    mse(model, x[mine], y[mine]).backward()
    ck.equal("all buckets launched by backward", len(opt._inflight), len(opt._buckets))
    ck.true("three buckets", len(opt._buckets) == 3)
    ck.raises(
        "zero_grad with allreduces outstanding",
        AssertionError,
        opt.zero_grad,
        "before optimizer.step()",
    )
    opt.step()
    opt.zero_grad()


def check_accumulation(hvd: Any, ck: Checks) -> None:
    """backward_passes_per_step: two half batches accumulate, then one allreduce."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    ref, model = make_model(), make_model()
    ref_opt = sgd(ref.parameters())
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), backward_passes_per_step=2)
    for step in range(2):
        x, y = make_batch(step, n, b)
        ref_opt.zero_grad()
        mse(ref, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        for i, half in enumerate(
            (slice(r * b, r * b + b // 2), slice(r * b + b // 2, (r + 1) * b))
        ):
            (mse(model, x[half], y[half]) / 2).backward()
            if i == 0:
                ck.equal("nothing launched after the first pass", len(opt._inflight), 0)
        opt.step()
    same_params(ck, "backward_passes_per_step=2", model, ref)
    loss = mse(model, x[mine], y[mine])
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)  # the second of backward_passes_per_step=2 launches
    ck.raises(
        "a pass too many", AssertionError, lambda: loss.backward(), "backward_passes_per_step"
    )
    opt.synchronize()
    opt.zero_grad()


def check_clipping(hvd: Any, ck: Checks) -> None:
    """Horovod's clipping pattern: synchronize, clip, step inside skip_synchronize."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(2):
        x, y = make_batch(step, n, b)
        ref_opt.zero_grad()
        mse(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        opt.zero_grad()
        mse(model, x[mine], y[mine]).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
    same_params(ck, "clip with skip_synchronize", model, ref)
    opt.zero_grad()
    mse(model, x[mine], y[mine]).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # synchronize() then step() without skip_synchronize: Horovod warns
    ck.true(
        "step after synchronize warns", any("skip_synchronize" in str(w.message) for w in caught)
    )


def check_unused_parameter(hvd: Any, ck: Checks) -> None:
    """A parameter without a gradient gets zeros (another rank may have one), no hang."""
    n, r, b = hvd.size(), hvd.rank(), 4
    mine = slice(r * b, (r + 1) * b)
    x, y = make_batch(1, n, b)  # the batch the clipping check trained on last
    model = make_model(extra=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mse(model, x[mine], y[mine]).backward()
    opt.step()
    ck.equal("unused parameter's grad", model.unused.grad, torch.zeros(2, 2, dtype=f64))


def check_optimizer_arguments(hvd: Any, ck: Checks) -> None:
    """Horovod's argument checks of DistributedOptimizer."""
    model = make_model()
    named = list(model.named_parameters())
    ck.raises(
        "duplicate names",
        ValueError,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[("w", p) for _, p in named],
        ),
        "duplicates: w",
    )
    ck.raises(
        "unnamed parameters",
        ValueError,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[:1]
        ),
        "not named",
    )
    ck.raises(
        "names not tuples",
        ValueError,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[[k, v] for k, v in named]
        ),
        "tuples",
    )
    ck.raises(
        "bad groups",
        ValueError,
        lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=-1),
        "non-negative",
    )
    ck.raises(
        "predivide with Sum",
        ValueError,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0
        ),
    )
    # op=hvd.Adasum: tests/world/test_horovod_adasum_ranks.py


def check_broadcast_parameters(hvd: Any, ck: Checks) -> None:
    """broadcast_parameters: a state_dict with buffers (an int64 one too), and named pairs."""
    n, r = hvd.size(), hvd.rank()
    root = n - 1

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        m[1].running_mean += seed
        m[1].num_batches_tracked += seed
        return m

    model, want = net(r), net(root)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    for (k, v), w in zip(model.state_dict().items(), want.state_dict().values(), strict=True):
        ck.equal(f"broadcast_parameters {k}", v, w)
    model = net(r)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    ck.equal("broadcast named parameters", model[0].weight.detach(), net(0)[0].weight.detach())
    ck.raises(
        "broadcast_parameters of a tensor",
        ValueError,
        lambda: hvd.broadcast_parameters(torch.ones(1), 0),
    )


def check_broadcast_optimizer_state(hvd: Any, ck: Checks) -> None:
    """broadcast_optimizer_state: only the root has stepped, and the lrs differ."""
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    for kind in ("sgd", "adam"):
        model = make_model()
        lr = 0.1 * (r + 1)
        opt = (
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.9))
        )
        x, y = make_batch(r, n, 2)
        for _ in range(2 if r == root else (1 if r % 2 else 0)):
            opt.zero_grad()
            mse(model, x, y).backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        sd = opt.state_dict()
        flat = (
            sd["param_groups"],
            {k: {n: v.tolist() for n, v in e.items()} for k, e in sd["state"].items()},
        )
        everyone = hvd.allgather_object(flat)
        ck.true(
            f"{kind}: every rank has the root's state", all(e == everyone[root] for e in everyone)
        )
        ck.equal(f"{kind}: lr", opt.param_groups[0]["lr"], 0.1 * n)
        ck.true(f"{kind}: state for every parameter", len(sd["state"]) == 4)
        opt.step()  # still a working optimizer
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    )
    x, y = make_batch(0, n, 2)
    mse(model, x, y).backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ck.equal("DistributedOptimizer lr after broadcast", opt.param_groups[0]["lr"], 0.1)
    opt.zero_grad()
    mse(model, x, y).backward()
    opt.step()  # hooks still work after load_state_dict
    lbfgs = torch.optim.LBFGS(model.parameters())
    ck.raises("LBFGS", ValueError, lambda: hvd.broadcast_optimizer_state(lbfgs, 0), "LBFGS")


def check_join(hvd: Any, ck: Checks) -> None:
    """Horovod's own join test: the first rank to join contributes zeros; Average still
    divides by the full size; join returns the last rank to join, the same everywhere."""
    n, r = hvd.size(), hvd.rank()
    for first in (0, n - 1):
        a = data((5,), 20, 0)
        b = data((3, 4), 21, 0)
        if r == first:
            last = hvd.join()
        else:
            ha, hb = hvd.allreduce_async(a, op=hvd.Average), hvd.allreduce_async(b, op=hvd.Average)
            ck.close(f"join first={first}: a", hvd.synchronize(ha), a * (n - 1) / n)
            ck.close(f"join first={first}: b", hvd.synchronize(hb), b * (n - 1) / n)
            last = hvd.join()
        ck.true(f"join first={first}: last is not the first", last != first)
        ck.equal(
            f"join first={first}: same answer everywhere", hvd.allgather_object(last), [last] * n
        )


def check_join_refusals(hvd: Any, ck: Checks) -> None:
    """Barrier and min/max are served; allgather, broadcast and alltoall are refused on the ranks
    that call them (Horovod: "... is not supported with Join at this time"), while the joined
    rank stays joined, and the job goes on."""
    n, r = hvd.size(), hvd.rank()
    if r == 0:
        last = hvd.join()
    else:
        refused = [
            ("allgather", lambda: hvd.allgather(torch.full((r, 2), float(r)))),
            ("broadcast", lambda: hvd.broadcast(torch.tensor([float(r)]), n - 1)),
            ("alltoall", lambda: hvd.alltoall(torch.ones(n))),
            ("broadcast from the joined rank", lambda: hvd.broadcast(torch.ones(1), 0)),
            ("broadcast_object", lambda: hvd.broadcast_object(r, n - 1)),
        ]
        for what, call in refused:
            e = ck.raises(
                f"join: {what} refused", hvd.HorovodInternalError, call, "not supported with Join"
            )
            ck.true(f"join: {what} names the joined rank", e is not None and "[0]" in str(e))
        hvd.barrier()
        ck.equal(
            "join: Max ignores the joined rank",
            hvd.allreduce(torch.tensor([-5.0 - r]), op=hvd.Max),
            torch.tensor([-6.0]),
        )
        ck.equal(
            "join: Sum over the others",
            hvd.allreduce(torch.ones(1), op=hvd.Sum),
            torch.tensor([n - 1.0]),
        )
        last = hvd.join()
    ck.equal("join: ties go to the highest rank", last, n - 1)


def check_join_in_training(hvd: Any, ck: Checks) -> None:
    """Uneven data: rank r trains 1 + r batches, then joins."""
    n, r = hvd.size(), hvd.rank()
    join_in_training(hvd, ck, n, r)


def check_join_without_the_call_check(hvd: Any, ck: Checks) -> None:
    """Join learns from plait's call check: without it, join refuses at once (no hang)."""
    os.environ["PLAIT_CHECK"] = "0"
    try:
        ck.raises("join without the call check", RuntimeError, hvd.join, "PLAIT_CHECK")
    finally:
        del os.environ["PLAIT_CHECK"]

"""plait.horovod.torch's collectives checked on one rank of a world, as Horovod's own tests check
them: every op and form, compression, async handles, grouped calls, process sets, the
errors, and the gradient of each collective. Each `check_X` is one section of
tests/world/test_horovod.py's battery.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from support.horovod_checks import Checks, data, f64


def check_facts(hvd: Any, ck: Checks) -> None:
    """Horovod's facts about this job: ranks, flags, what torch was built with."""
    n, r = hvd.size(), hvd.rank()
    ck.equal("local", (hvd.local_rank(), hvd.local_size()), (r, n))
    ck.equal("cross (one node)", (hvd.cross_rank(), hvd.cross_size()), (0, 1))
    ck.true("flags", hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_enabled())
    ck.true("homogeneous", hvd.is_homogeneous() and hvd.is_initialized())
    # build facts, as Horovod's: this torch's NCCL (a version code, 0 without), CUDA or not
    ck.equal("nccl_built", bool(hvd.nccl_built()), torch.distributed.is_nccl_available())
    ck.equal("cuda_built", hvd.cuda_built(), torch.version.cuda is not None)


def check_allreduce_ops(hvd: Any, ck: Checks) -> None:
    """Every op, both dtypes, with and without scaling (Horovod: pre before, post after);
    Average and its deprecated forms."""
    n, r = hvd.size(), hvd.rank()
    for dtype in (torch.float32, torch.int64):
        xs = [data((4, 3), 1, q, dtype) for q in range(n)]
        x = xs[r].clone()
        stack = torch.stack(xs)
        ck.equal(f"Sum {dtype}", hvd.allreduce(x, op=hvd.Sum), stack.sum(0))
        ck.equal(f"Min {dtype}", hvd.allreduce(x, op=hvd.Min), stack.amin(0))
        ck.equal(f"Max {dtype}", hvd.allreduce(x, op=hvd.Max), stack.amax(0))
        ck.equal(f"Product {dtype}", hvd.allreduce(x, op=hvd.Product), stack.prod(0))
        ck.equal(f"input unchanged {dtype}", x, xs[r])
        scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
        ck.equal(f"Sum pre*post {dtype}", scaled, stack.sum(0) * 6)
    xs = [data((5,), 2, q) for q in range(n)]
    ck.close("Average (default op)", hvd.allreduce(xs[r]), torch.stack(xs).mean(0))
    got = hvd.allreduce(xs[r], prescale_factor=0.5, postscale_factor=4.0)
    ck.close("Average pre/post", got, torch.stack(xs).mean(0) * 2)
    ones = torch.ones(3, dtype=torch.int32)
    ck.equal(
        "int prescale truncates",
        hvd.allreduce(ones, op=hvd.Sum, prescale_factor=1.5),
        torch.full((3,), n, dtype=torch.int32),
    )
    # op=hvd.Adasum: tests/world/test_horovod_adasum_ranks.py
    ck.raises("op and average", ValueError, lambda: hvd.allreduce(xs[r], average=True, op=hvd.Sum))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.close("average=False", hvd.allreduce(xs[r], average=False), torch.stack(xs).sum(0))
    ck.true("average= is deprecated", any(w.category is DeprecationWarning for w in caught))


def check_compression(hvd: Any, ck: Checks) -> None:
    """fp16 and bf16 compression: sent in the smaller dtype, returned in the input's."""
    n, r = hvd.size(), hvd.rank()
    # fp16 compression: sent as float16, returned in the input's dtype
    xs = [data((6,), 3, q) / 4 for q in range(n)]
    got = hvd.allreduce(xs[r], op=hvd.Sum, compression=hvd.Compression.fp16)
    ck.equal("fp16 compression keeps dtype", got.dtype, torch.float32)
    ck.close("fp16 compression", got, torch.stack(xs).sum(0), atol=1e-3, rtol=1e-3)
    half, ctx = hvd.Compression.fp16.compress(xs[r])
    ck.equal("fp16 compress", half.dtype, torch.float16)
    ck.equal("fp16 decompress", hvd.Compression.fp16.decompress(half, ctx).dtype, torch.float32)
    ints = torch.arange(3)
    ck.equal("fp16 leaves ints", hvd.Compression.fp16.compress(ints)[0], ints)
    # bf16 (plait's): float32's range, so a sum fp16 would overflow (65504) stays finite;
    # the result is the exact sum up to bf16's rounding (2^-8 relative at most) of each
    # term and partial sum, each at most n * 1e5 here
    big = [x * 1e5 for x in xs]
    got = hvd.allreduce(big[r], op=hvd.Sum, compression=hvd.Compression.bf16)
    exact = torch.stack(big).sum(0)
    ck.equal("bf16 compression keeps dtype", got.dtype, torch.float32)
    ck.true("bf16 does not overflow", bool(torch.isfinite(got).all()))
    ck.close("bf16 compression", got, exact, rtol=0, atol=n * n * 2**-8 * 1e5)
    ck.true("bf16 rounds", not torch.equal(got, exact))
    ck.equal("bf16 compress", hvd.Compression.bf16.compress(xs[r])[0].dtype, torch.bfloat16)
    ck.equal("bf16 leaves ints", hvd.Compression.bf16.compress(ints)[0], ints)


def check_async(hvd: Any, ck: Checks) -> None:
    """In place, async, poll and synchronize."""
    n, r = hvd.size(), hvd.rank()
    xs = [data((3, 2), 4, q) for q in range(n)]
    x = xs[r].clone()
    ck.true("allreduce_ returns its argument", hvd.allreduce_(x, op=hvd.Sum) is x)
    ck.equal("allreduce_", x, torch.stack(xs).sum(0))
    view = xs[r].clone().t()  # not contiguous
    hvd.allreduce_(view, op=hvd.Max)
    ck.equal("allreduce_ on a transposed view", view, torch.stack(xs).amax(0).t())
    h1 = hvd.allreduce_async(xs[r], op=hvd.Sum, postscale_factor=0.5)
    y = xs[r].clone()
    h2 = hvd.allreduce_async_(y, op=hvd.Min)
    h3 = hvd.allgather_async(xs[r])
    ck.true("handles are ints", all(isinstance(h, int) for h in (h1, h2, h3)))
    ck.true("poll gives a bool", isinstance(hvd.poll(h1), bool))
    ck.equal("async gather", hvd.synchronize(h3), torch.cat(xs))
    ck.true("earlier handles finished first", hvd.poll(h1) and hvd.poll(h2))
    ck.equal("async allreduce", hvd.synchronize(h1), torch.stack(xs).sum(0) * 0.5)
    ck.true("async in place returns the tensor", hvd.synchronize(h2) is y)
    ck.equal("async in place", y, torch.stack(xs).amin(0))
    ck.true("synchronize of a spent handle", hvd.synchronize(h1) is None)
    ck.raises("poll of a spent handle", ValueError, lambda: hvd.poll(h1))


def check_grouped(hvd: Any, ck: Checks) -> None:
    """Grouped allreduce: one buffer per dtype."""
    n, r = hvd.size(), hvd.rank()
    a = [data((2, 2), 5, q) for q in range(n)]
    b = [data((3,), 6, q, torch.int64) for q in range(n)]
    c = [data((1,), 7, q) for q in range(n)]
    want = [torch.stack(v).sum(0) for v in (a, b, c)]
    got = hvd.grouped_allreduce([a[r], b[r], c[r]], op=hvd.Sum)
    for i in range(3):
        ck.equal(f"grouped_allreduce {i}", got[i], want[i])
    mine = [a[r].clone(), b[r].clone(), c[r].clone()]
    out = hvd.grouped_allreduce_(mine, op=hvd.Sum)
    ck.true(
        "grouped_allreduce_ returns its tensors",
        all(o is m for o, m in zip(out, mine, strict=True)),
    )
    for i in range(3):
        ck.equal(f"grouped_allreduce_ {i}", mine[i], want[i])
    h = hvd.grouped_allreduce_async([a[r], c[r]], prescale_factor=2.0)
    got = hvd.synchronize(h)
    ck.close("grouped async Average", got[0], torch.stack(a).mean(0) * 2)
    mine = [a[r].clone(), b[r].clone()]
    hvd.synchronize(hvd.grouped_allreduce_async_(mine, op=hvd.Sum))
    ck.equal("grouped async in place", mine[1], want[1])
    got = hvd.grouped_allreduce([a[r], c[r]], op=hvd.Sum, compression=hvd.Compression.fp16)
    ck.close("grouped fp16", got[1], want[2])


def check_allgather(hvd: Any, ck: Checks) -> None:
    """Allgather with a different dim 0 per rank (rank 0 sends none), alone and grouped."""
    n, r = hvd.size(), hvd.rank()
    parts = [torch.full((q, 2), float(q)) for q in range(n)]
    ck.equal("allgather uneven", hvd.allgather(parts[r]), torch.cat(parts))
    got = hvd.synchronize(hvd.grouped_allgather_async([parts[r], parts[r][:, :1].long()]))
    ck.equal("grouped_allgather_async", got[1], torch.cat(parts)[:, :1].long())
    ck.equal("grouped_allgather", hvd.grouped_allgather([parts[r]])[0], torch.cat(parts))


def check_broadcast(hvd: Any, ck: Checks) -> None:
    """Broadcast from every root, in every form; a bad root names the valid range."""
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        xs = [data((2, 3), 8 + root, q) for q in range(n)]
        ck.equal(f"broadcast root {root}", hvd.broadcast(xs[r], root), xs[root])
        y = xs[r].clone()
        hvd.broadcast_(y, root_rank=root)
        ck.equal(f"broadcast_ root {root}", y, xs[root])
        y = xs[r].clone()
        ck.equal(
            f"broadcast_async_ {root}", hvd.synchronize(hvd.broadcast_async_(y, root)), xs[root]
        )
        ck.equal(
            f"broadcast_async {root}", hvd.synchronize(hvd.broadcast_async(xs[r], root)), xs[root]
        )
    ck.raises("bad root", ValueError, lambda: hvd.broadcast(torch.ones(1), n), f"[0, {n})")
    ck.raises("negative root", ValueError, lambda: hvd.broadcast_(torch.ones(1), -1), f"[0, {n})")


def check_alltoall(hvd: Any, ck: Checks) -> None:
    """Alltoall with and without splits."""
    n, r = hvd.size(), hvd.rank()
    # alltoall: rank r sends q+1 rows to rank q, each row holding (sender, receiver)
    splits = [q + 1 for q in range(n)]
    rows = torch.tensor([[r, q] for q in range(n) for _ in range(q + 1)], dtype=torch.float32)
    out, received = hvd.alltoall(rows, splits=splits)
    want = torch.tensor([[q, r] for q in range(n) for _ in range(r + 1)], dtype=torch.float32)
    ck.equal("alltoall", out, want)
    ck.equal("alltoall received splits", received, torch.full((n,), r + 1, dtype=torch.int32))
    out, received = hvd.synchronize(
        hvd.alltoall_async(rows, torch.tensor(splits, dtype=torch.int32))
    )
    ck.equal("alltoall_async", out, want)
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    ck.equal(
        "alltoall without splits",
        hvd.alltoall(even),
        torch.tensor([100.0 * q + 2 * r + i for q in range(n) for i in range(2)]),
    )
    ck.raises("alltoall bad splits", ValueError, lambda: hvd.alltoall(rows, splits=[1] * (n + 1)))


def check_reducescatter(hvd: Any, ck: Checks) -> None:
    """Reducescatter, scaled, async and grouped."""
    n, r = hvd.size(), hvd.rank()
    # reducescatter: lower ranks get the extra row when dim 0 does not divide evenly
    xs = [data((2 * n + 1, 2), 9, q) for q in range(n)]
    total = torch.stack(xs).sum(0)
    mine = total.tensor_split(n)[r]
    ck.equal("reducescatter Sum", hvd.reducescatter(xs[r], op=hvd.Sum), mine)
    ck.close("reducescatter Average (default)", hvd.reducescatter(xs[r]), mine / n)
    got = hvd.reducescatter(xs[r], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    ck.close("reducescatter scaled", got, mine / 2)
    ck.equal(
        "reducescatter_async", hvd.synchronize(hvd.reducescatter_async(xs[r], op=hvd.Sum)), mine
    )
    got = hvd.grouped_reducescatter([xs[r], xs[r][:, :1]], op=hvd.Sum)
    ck.equal("grouped_reducescatter", got[1], total[:, :1].tensor_split(n)[r])
    got = hvd.synchronize(hvd.grouped_reducescatter_async([xs[r]], op=hvd.Sum))
    ck.equal("grouped_reducescatter_async", got[0], mine)


def check_objects(hvd: Any, ck: Checks) -> None:
    """Objects broadcast and gathered; the barrier."""
    n, r = hvd.size(), hvd.rank()
    ck.equal(
        "broadcast_object", hvd.broadcast_object({"from": r}, root_rank=n - 1), {"from": n - 1}
    )
    ck.equal("allgather_object", hvd.allgather_object(("rank", r)), [("rank", q) for q in range(n)])
    hvd.barrier()


def check_mismatch(hvd: Any, ck: Checks) -> None:
    """Ranks that disagree fail alike on every rank, under Horovod's and plait's names."""
    import plait

    n, r = hvd.size(), hvd.rank()
    e = ck.raises(
        "mismatched shapes", hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(r + 1))
    )
    ck.true("mismatch is plait's error too", isinstance(e, plait.CollectiveMismatchError))
    ck.true("mismatch is a RuntimeError", isinstance(e, RuntimeError))
    h = hvd.allreduce_async(torch.ones(2, r + 1))
    ck.raises("async mismatch", plait.CollectiveMismatchError, lambda: hvd.synchronize(h))
    ck.equal(
        "usable after a mismatch",
        hvd.allreduce(torch.ones(2), op=hvd.Sum),
        torch.full((2,), float(n)),
    )


def check_process_sets(hvd: Any, ck: Checks) -> None:
    """Process sets: the even ranks, and the last two."""
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    last = hvd.ProcessSet([n - 2, n - 1])
    if n == 2:  # the same ranks as the global set: Horovod refuses duplicates too
        ck.raises("duplicate process set", ValueError, lambda: hvd.add_process_set(last), "exists")
    else:
        hvd.add_process_set(last)
    ck.equal("process set size", evens.size(), len(range(0, n, 2)))
    if evens.included():
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=evens)
        ck.equal("allreduce on a process set", got, torch.full((1,), float(evens.size())))
        ck.equal("process set rank", evens.rank(), r // 2)
    else:
        ck.raises("non-member", ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=evens))
    if last.included():
        got = hvd.allgather(torch.tensor([r]), process_set=last)
        ck.equal("allgather on a process set", got, torch.tensor([n - 2, n - 1]))
    ck.true(
        "remove_process_set", hvd.remove_process_set(evens) and not hvd.remove_process_set(evens)
    )
    # the timeline's own checks: tests/world/test_horovod_timeline.py


def check_gradients(hvd: Any, ck: Checks) -> None:
    """The gradient of every collective, as Horovod defines it."""
    n, r = hvd.size(), hvd.rank()
    # allreduce: the gradient is the same allreduce of the gradient (Horovod's definition)
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.ones(4, requires_grad=True)
        hvd.allreduce(x * 2, op=op).backward(torch.ones(4))
        ck.close(f"allreduce grad op {op}", x.grad, torch.full((4,), 2.0 * factor))
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0).backward(
        torch.ones(3) * (r + 1)
    )
    ck.close("allreduce grad scaled", x.grad, torch.full((3,), 6.0 * sum(range(1, n + 1))))
    x = torch.ones(3, requires_grad=True)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    out.sum().backward()
    ck.close("fp16 allreduce grad", x.grad, torch.full((3,), float(n)))
    # grouped allreduce
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, dtype=f64, requires_grad=True)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    (outs[0].sum() + outs[1].sum()).backward()
    ck.close("grouped grad 0", xs[0].grad, torch.full((2,), float(n)))
    ck.close("grouped grad 1", xs[1].grad, torch.full((3,), float(n), dtype=f64))
    # allgather: Average allreduce of the gradient, this rank's rows (Horovod's test: rows
    # of rank q carry gradient q, the same on every rank, so rank r gets r back)
    sizes = [q + 1 for q in range(n)]
    x = torch.randn(sizes[r], 3, requires_grad=True)
    grad = torch.cat([torch.full((s, 3), float(q)) for q, s in enumerate(sizes)])
    hvd.allgather(x).backward(grad)
    ck.close("allgather grad", x.grad, torch.full((sizes[r], 3), float(r)))
    x = torch.zeros(2, requires_grad=True)
    hvd.allgather(x).backward(torch.full((2 * n,), float(r)))  # differs per rank: averaged
    ck.close("allgather grad averaged", x.grad, torch.full((2,), (n - 1) / 2))
    # broadcast: the Average allreduce on the root, zeros elsewhere
    for root in range(n):
        x = torch.ones(3, requires_grad=True)
        hvd.broadcast(x, root).backward(torch.full((3,), float(r)))
        want = (n - 1) / 2 if r == root else 0.0
        ck.close(f"broadcast grad root {root}", x.grad, torch.full((3,), want))
    # reducescatter: Sum's gradient is size * allgather(grad), Average's allgather(grad)
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.ones(2 * n, 2, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(2, 2))
        ck.close(f"reducescatter grad op {op}", x.grad, torch.full((2 * n, 2), float(factor)))
    # alltoall: the gradient goes back to where each row came from
    splits = [q + 1 for q in range(n)]
    x = torch.zeros(sum(splits), requires_grad=True)
    out, _ = hvd.alltoall(x, splits=splits)
    out.backward(torch.arange(out.numel(), dtype=torch.float32) + 100 * r)
    # rank q received r+1 rows from us, at offset sum over senders before us of (q+1)
    want = torch.cat(
        [
            torch.arange(r * (q + 1), (r + 1) * (q + 1), dtype=torch.float32) + 100 * q
            for q in range(n)
        ]
    )
    ck.close("alltoall grad", x.grad, want)

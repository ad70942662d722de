"""Checks of Horovod's negotiation by name (issue 33), run in test_horovod_parity.py's worlds:
named ops meet by name whatever order ranks post them in; unnamed ones by order."""

from __future__ import annotations

from typing import Any

import torch

from support.horovod_checks import Checks, make_batch, same_params


def check_duplicate_names(hvd: Any, ck: Checks, comm: Any) -> None:
    """Horovod's four test_horovod_*_duplicate_name_error (test/parallel/test_torch.py): a
    rank that posts a name again while the first is still in flight gets ValueError; the
    firsts then meet, with the right result.

    Horovod's test lets the last rank to post check its duplicate after its first could
    already have run (its cycle time makes that unlikely; plait's event-driven sequencer
    made it fail one CI run in many), and a name is free again once its op has run, so here
    every rank checks while some other rank has not posted the name yet: rank 0 checks
    "dup_a" before the others post it; they check "dup_b" before rank 0 posts it."""
    n, r = comm.size, comm.rank
    tensor = torch.full((17, 17, 17), float(r + 1))
    starts = {
        "allreduce": lambda nm: hvd.allreduce_async(tensor, name=nm, op=hvd.Sum),
        "allgather": lambda nm: hvd.allgather_async(tensor, name=nm),
        "broadcast": lambda nm: hvd.broadcast_async(tensor, name=nm, root_rank=0),
        "reducescatter": lambda nm: hvd.reducescatter_async(tensor, name=nm, op=hvd.Sum),
    }
    total = n * (n + 1) / 2
    rows = [(17 + n - 1 - q) // n for q in range(n)]  # reducescatter: lower ranks one more row
    wants = {
        "allreduce": torch.full((17, 17, 17), total),
        "allgather": torch.cat([torch.full((17, 17, 17), float(q + 1)) for q in range(n)]),
        "broadcast": torch.full((17, 17, 17), 1.0),
        "reducescatter": torch.full((rows[r], 17, 17), total),
    }
    for what, start in starts.items():
        again = f"{what}: the same name again"
        if r == 0:
            first_a = start("dup_a")
            ck.raises(again, ValueError, lambda s=start: s("dup_a"), "same name")
        hvd.barrier()
        if r > 0:
            first_b = start("dup_b")
            ck.raises(again, ValueError, lambda s=start: s("dup_b"), "same name")
            first_a = start("dup_a")  # the last to post "dup_a": it may run at once
        hvd.barrier()
        if r == 0:
            first_b = start("dup_b")
        ck.equal(f"{what}: the firsts met (dup_a)", hvd.synchronize(first_a), wants[what])
        ck.equal(f"{what}: the firsts met (dup_b)", hvd.synchronize(first_b), wants[what])


def check_names_in_any_order(hvd: Any, ck: Checks, comm: Any) -> None:
    """Named async ops posted in reversed order on the odd ranks, synchronized in a third
    order; a name meets its namesake, not the op posted at the same place. One rank waits
    for Y before posting X while the others posted X first (Horovod does not deadlock).
    A blocking named op meets an async one; an allreduce and an allgather may share a name
    (Horovod prefixes it with the op); shapes that differ under one name are an error."""
    n, r = comm.size, comm.rank
    names = [f"n{i}" for i in range(6)]
    order = names[::-1] if r % 2 else names
    value = {nm: float(10 * i + r) for i, nm in enumerate(names)}  # differs per name and rank
    handles = {}
    for nm in order:
        t = torch.full((3,), value[nm])
        i = names.index(nm)
        if i % 3 == 0:
            handles[nm] = hvd.allreduce_async(t, name=nm, op=hvd.Sum)
        elif i % 3 == 1:
            handles[nm] = hvd.allgather_async(t[:1], name=nm)
        else:
            handles[nm] = hvd.broadcast_async(t, root_rank=n - 1, name=nm)
    for nm in sorted(names, key=lambda s: (int(s[1:]) * 7) % 6):
        i = names.index(nm)
        got = hvd.synchronize(handles[nm])
        if i % 3 == 0:
            want = torch.full((3,), float(n * 10 * i + sum(range(n))))
        elif i % 3 == 1:
            want = torch.tensor([float(10 * i + q) for q in range(n)])
        else:
            want = torch.full((3,), float(10 * i + n - 1))
        ck.equal(f"reversed order: {nm}", got, want)
    one = torch.ones(2)
    if r == 0:
        hx = hvd.allreduce_async(one, name="X", op=hvd.Sum)
        hy = hvd.allreduce_async(one * 2, name="Y", op=hvd.Sum)
        ck.equal("X before Y: Y", hvd.synchronize(hy), torch.full((2,), 2.0 * n))
        ck.equal("X before Y: X", hvd.synchronize(hx), torch.full((2,), float(n)))
    else:
        hy = hvd.allreduce_async(one * 2, name="Y", op=hvd.Sum)
        ck.equal("Y waited before X: Y", hvd.synchronize(hy), torch.full((2,), 2.0 * n))
        hx = hvd.allreduce_async(one, name="X", op=hvd.Sum)
        ck.equal("Y waited before X: X", hvd.synchronize(hx), torch.full((2,), float(n)))
    if r == 0:
        got = hvd.allreduce(one * (r + 1), name="s", op=hvd.Sum)
        hvd.barrier()  # unnamed: passes the named op, in either direction
    else:
        h = hvd.allreduce_async(one * (r + 1), name="s", op=hvd.Sum)
        hvd.barrier()
        got = hvd.synchronize(h)
    ck.equal("blocking meets async", got, torch.full((2,), n * (n + 1) / 2))
    h1 = hvd.allreduce_async(one, name="z", op=hvd.Sum)
    h2 = hvd.allgather_async(one[:1], name="z")
    ck.equal("one name, two ops: allreduce", hvd.synchronize(h1), torch.full((2,), float(n)))
    ck.equal("one name, two ops: allgather", hvd.synchronize(h2), torch.ones(n))
    ck.raises(
        "shapes differ under one name",
        hvd.HorovodInternalError,
        lambda: hvd.allreduce(torch.ones(r + 1), name="mm"),
        "'allreduce.mm'",
    )
    ck.equal("after the mismatch", hvd.allreduce(one, name="mm", op=hvd.Sum), one * n)


def check_hooks_in_any_order(hvd: Any, ck: Checks, comm: Any) -> None:
    """DistributedOptimizer's gradient hooks fire in a different order on every other rank
    (two branches, built in the opposite order, so autograd reaches them the other way
    round), one bucket per parameter: the step equals one process's on the whole batch."""
    n, r = comm.size, comm.rank

    def branches(seed: int) -> torch.nn.ModuleList:
        torch.manual_seed(seed)
        return torch.nn.ModuleList([torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)]).double()

    def loss(m: torch.nn.ModuleList, x: torch.Tensor, y: torch.Tensor, flip: bool) -> Any:
        a, b = (m[1], m[0]) if flip else (m[0], m[1])
        out_a = a(x)  # built first: its gradients come last
        return mse_of(out_a + b(x), y)

    def mse_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    model = branches(3)
    fired: list[int] = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.append(i))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        groups=[[p] for p in model.parameters()],
    )
    ref = branches(3)
    b = 2
    for step in range(3):
        x, y = make_batch(step, n, b)
        opt.zero_grad()
        loss(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b], flip=r % 2 == 1).backward()
        opt.step()
        ref.zero_grad()
        for q in range(n):  # the mean of the ranks' means
            (loss(ref, x[q * b : (q + 1) * b], y[q * b : (q + 1) * b], False) / n).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
    orders = hvd.allgather_object(fired[:4])
    ck.true(f"hooks fired in different orders: {orders}", orders[0] != orders[1])
    same_params(ck, "hooks in any order", model, ref)

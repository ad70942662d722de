"""Rank bodies that send every collective, and ordered messages, over the links CUDA tensors
take: run on CPU tensors (tests/world/test_comm_links.py) and on CUDA ones (test_comm_cuda.py)."""

from __future__ import annotations

import torch

from plait.comm.dispatch import routes


def _inputs(rank: int, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(-2, 3, (n,), generator=g).to(torch.float32)


def every_collective(comm: object, device: str = "cpu") -> dict[str, object]:
    """Each collective and algorithm on small-integer inputs on `device`, against the
    one-process result; and how many engine messages a ring allreduce cost, how many rows
    were staged. Also run on CUDA tensors by tests/world/test_comm_cuda.py."""
    import plait.comm.backends.cuda as cuda_module

    staged = []
    real = cuda_module.staged
    cuda_module.staged = lambda buf, run: staged.append(buf.numel()) or real(buf, run)
    p, r = comm.size, comm.rank
    on = torch.device(device)

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:  # equal, and on `device`
        return got.device.type == on.type and torch.equal(got.cpu(), want.cpu())

    rows = torch.stack([_inputs(k) for k in range(p)])  # (p, n): rank k's inputs
    total, mine = rows.sum(0), rows[r].to(on)

    def algorithms(collective: str) -> tuple[str, ...]:  # every row that runs on one host
        return ("auto", *routes.usable(collective, comm.topology))

    for algorithm in algorithms("allreduce"):
        assert same(comm.allreduce(mine, algorithm=algorithm), total), algorithm
        assert same(comm.allreduce(mine, "max", algorithm=algorithm), rows.amax(0)), algorithm
    for algorithm in algorithms("broadcast"):
        assert same(comm.broadcast(mine, 1, algorithm=algorithm), rows[1]), algorithm
    for algorithm in algorithms("reduce"):
        reduced = comm.reduce(mine, 2 % p, algorithm=algorithm)
        assert (reduced is None) == (r != 2 % p)
        assert reduced is None or same(reduced, total), algorithm
    for algorithm in algorithms("allgather"):
        assert same(comm.allgather(mine.view(10, -1), algorithm), rows.view(-1, 100)), algorithm
    for algorithm in algorithms("reduce_scatter"):
        part = comm.reduce_scatter(torch.ones(p * 6, 5, device=on) * (r + 1), algorithm=algorithm)
        assert same(part, torch.full((6, 5), float(sum(range(1, p + 1))))), algorithm
    request = comm.allreduce_async(mine)
    assert same(request.wait(), total) and same(request.synchronize(), total)
    uneven = torch.arange(r + 1, dtype=torch.float32, device=on)  # unequal blocks
    expect = torch.cat([torch.arange(k + 1, dtype=torch.float32) for k in range(p)])
    assert same(comm.allgather(uneven), expect)
    sent = torch.arange(p * 2, dtype=torch.float32, device=on) + 100 * r  # 2 rows to each
    assert same(
        comm.alltoall(sent),
        torch.cat([torch.arange(2 * r, 2 * r + 2) + 100.0 * k for k in range(p)]),
    )
    gathered = comm.gather(uneven, root=0)
    assert (gathered is None) == (r != 0) and (gathered is None or same(gathered, expect))
    part = comm.scatter(torch.arange(p * 3.0, device=on) if r == 1 else None, root=1)
    assert same(part, torch.arange(3.0 * r, 3.0 * r + 3))
    comm.barrier()
    if p > 1:  # point to point (on GPUs staged over the engine, tags kept)
        got = comm.recv(torch.empty(3, device=on), (r - 1) % p, tag=5) if r % 2 else None
        comm.send(torch.full((3,), float(r), device=on), (r + 1) % p, tag=5)
        if r % 2 == 0:
            got = comm.recv(torch.empty(3, device=on), (r - 1) % p, tag=5)
        assert same(got, torch.full((3,), float((r - 1) % p)))
    # structure: a ring allreduce's data messages through the engine (check=False leaves
    # the mismatch check's records out): none over a group link, 2(p-1) or more otherwise
    before = sum(s for s, _ in comm.engine.counts().values())
    comm.allreduce(torch.ones(1 << 16, device=on), algorithm="ring", check=False)
    engine_messages = sum(s for s, _ in comm.engine.counts().values()) - before
    comm.barrier()
    cuda_module.staged = real
    return {"engine_messages": engine_messages, "staged": len(staged)}


def ordered_messages(comm: object, device: str = "cpu") -> dict[str, object]:
    """Ordered messages (the pipeline's payloads) on `device` between neighbours, both ways at
    once: received in sending order whatever their tags, and over the lanes, not the engine
    (also run on CUDA tensors, over NCCL, by tests/world/test_comm_cuda.py)."""
    r, p, on = comm.rank, comm.size, torch.device(device)
    comm.connect_lanes()  # every rank: the lanes' groups (NCCL's, or gloo's under the hook)
    before = sum(s for s, _ in comm.engine.counts().values())
    sends = []
    for k in range(3):  # to both neighbours, tags counting down: the order is what matches
        for peer in {(r + 1) % p, (r - 1) % p}:
            t = torch.full((5,), 10.0 * r + k, device=on)
            sends.append(comm.isend(t, peer, tag=9 - k, ordered=True))
    got = {}
    for peer in sorted({(r + 1) % p, (r - 1) % p}):
        got[peer] = [
            float(comm.recv(torch.empty(5, device=on), peer, tag=0, ordered=True)[0])
            for _ in range(3)
        ]
    for s in sends:
        s.wait()
    engine_messages = sum(s for s, _ in comm.engine.counts().values()) - before
    comm.barrier()
    return {"got": got, "engine_messages": engine_messages}

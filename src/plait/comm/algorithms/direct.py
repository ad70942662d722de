"""Direct (one-round or dissemination) schedules: gather, scatter, alltoall, barrier.

These move each block straight from its source to its destination. Empty blocks are not
sent; both sides know every block's size, so they skip the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.comm.core.channel import Channel, sendrecv, wait_all


def gather(
    ch: Channel,
    send: torch.Tensor,
    recv_blocks: Sequence[torch.Tensor] | None,
    root: int = 0,
) -> None:
    """Gather every rank's `send` into `recv_blocks[rank]` on `root` (None elsewhere is fine)."""
    p, r = ch.size, ch.rank
    if r != root:
        if send.numel():
            ch.isend(send, root).wait()
        return
    blocks = _check_blocks(ch, recv_blocks, "recv_blocks")
    reqs = [ch.irecv(blocks[j], j) for j in _rotation(r, p, -1) if blocks[j].numel()]
    blocks[r].copy_(send)
    wait_all(reqs)


def scatter(
    ch: Channel,
    send_blocks: Sequence[torch.Tensor] | None,
    recv: torch.Tensor,
    root: int = 0,
) -> None:
    """Send `send_blocks[j]` from `root` to rank j's `recv` (send_blocks is read on root only)."""
    p, r = ch.size, ch.rank
    if r != root:
        if recv.numel():
            ch.irecv(recv, root).wait()
        return
    blocks = _check_blocks(ch, send_blocks, "send_blocks")
    reqs = [ch.isend(blocks[j], j) for j in _rotation(r, p, 1) if blocks[j].numel()]
    recv.copy_(blocks[r])
    wait_all(reqs)


def alltoall(
    ch: Channel, send_blocks: Sequence[torch.Tensor], recv_blocks: Sequence[torch.Tensor]
) -> None:
    """Personalized exchange: send_blocks[j] goes to rank j, recv_blocks[j] comes from rank j.

    All receives are posted first, then the sends in rotated order (rank+1, rank+2, ...),
    while receives run rank-1, rank-2, ...: at any moment each rank is the target of one
    sender instead of everybody sending to rank 0 first.
    """
    p, r = ch.size, ch.rank
    send = _check_blocks(ch, send_blocks, "send_blocks")
    recv = _check_blocks(ch, recv_blocks, "recv_blocks")
    reqs = [ch.irecv(recv[j], j) for j in _rotation(r, p, -1) if recv[j].numel()]
    reqs += [ch.isend(send[j], j) for j in _rotation(r, p, 1) if send[j].numel()]
    recv[r].copy_(send[r])
    wait_all(reqs)


def allgather_small(ch: Channel, send: torch.Tensor, recv_blocks: Sequence[torch.Tensor]) -> None:
    """Every rank sends `send` straight to every other rank: one round, for tiny metadata."""
    p, r = ch.size, ch.rank
    recv = _check_blocks(ch, recv_blocks, "recv_blocks")
    reqs = [ch.irecv(recv[j], j) for j in _rotation(r, p, -1) if recv[j].numel()]
    if send.numel():
        reqs += [ch.isend(send, j) for j in _rotation(r, p, 1)]
    recv[r].copy_(send)
    wait_all(reqs)


def barrier(ch: Channel) -> None:
    """Dissemination barrier (Hensgen, Finkel & Manber 1988): ceil(lg p) rounds.

    Round k: send an empty message to rank+2^k, receive one from rank-2^k. After round k
    each rank has (transitively) heard from the 2^(k+1) ranks below it, so after
    ceil(lg p) rounds it has heard from all of them.
    """
    p, r = ch.size, ch.rank
    token, ack = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)
    dist = 1
    while dist < p:
        sendrecv(ch, token, (r + dist) % p, ack, (r - dist) % p)
        dist <<= 1


def _rotation(r: int, p: int, sign: int) -> list[int]:
    """The other ranks in the order r+k (sign 1) or r-k (sign -1), k = 1..p-1."""
    return [(r + sign * k) % p for k in range(1, p)]


def _check_blocks(
    ch: Channel, blocks: Sequence[torch.Tensor] | None, name: str
) -> Sequence[torch.Tensor]:
    if blocks is None or len(blocks) != ch.size:
        got = "None" if blocks is None else f"{len(blocks)} blocks"
        raise ValueError(f"{name} must hold one tensor per rank ({ch.size}); got {got}")
    return blocks

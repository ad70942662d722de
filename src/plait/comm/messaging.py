"""Point-to-point messages and Python-object collectives, mixed into the Communicator.

Objects are pickled, like torch.distributed's and Horovod's object collectives: they travel
only between the job's own ranks, which run the same code. Nothing a server receives is
unpickled (servers use their own wire format).
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import torch

from plait.comm.calls import Call, dtype_name
from plait.comm.frames import Request

if TYPE_CHECKING:
    from plait.comm.communicator import Communicator

_USER_TAG = 1 << 63
_MAX_USER_TAG = (1 << 32) - 1


def _p2p_args(comm: Communicator, t: object, peer: object, tag: object, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor; got {type(t).__name__}")
    dtype_name(t.dtype)
    if not isinstance(peer, int) or not 0 <= peer < comm.size or peer == comm.rank:
        raise ValueError(
            f"{what} peer must be another rank in [0, {comm.size}) (this is rank "
            f"{comm.rank}); got {peer!r}"
        )
    if not isinstance(tag, int) or not 0 <= tag <= _MAX_USER_TAG:
        raise ValueError(f"tag must be an int in [0, {_MAX_USER_TAG}]; got {tag!r}")
    if comm._engine.error is not None:
        raise comm._engine.error
    return _USER_TAG | (comm._id << 33) | tag


def isend(comm: Communicator, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
    """Start sending `tensor` to rank `dst`; don't modify it until `wait()`."""
    full = _p2p_args(comm, tensor, dst, tag, "send")
    return comm._engine.isend(tensor.contiguous().view(-1), comm.ranks[dst], full)


def irecv(comm: Communicator, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
    """Start receiving into `tensor` (contiguous, the sent size) from rank `src`."""
    full = _p2p_args(comm, tensor, src, tag, "recv")
    if not tensor.is_contiguous():
        raise ValueError("irecv needs a contiguous tensor (use recv, which copies for you)")
    return comm._engine.irecv(tensor.view(-1), comm.ranks[src], full)


def send(comm: Communicator, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    """Send `tensor` to rank `dst` and wait until it is on its way."""
    isend(comm, tensor, dst, tag).wait()


def recv(comm: Communicator, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receive from rank `src` into `tensor` (its shape and dtype must match); return it."""
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    irecv(comm, buf, src, tag).wait()
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def broadcast_object(comm: Communicator, obj: Any = None, root: int = 0) -> Any:
    """Return root's `obj` on every rank (pickled; job-internal only)."""
    root = comm._root(root)
    if comm.rank == root:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    comm.broadcast_(size, root)
    if comm.rank != root:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.broadcast_(data, root)
    return obj if comm.rank == root else pickle.loads(data.numpy().tobytes())


def allgather_object(comm: Communicator, obj: Any) -> list[Any]:
    """Return every rank's `obj`, in rank order (pickled; job-internal only)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    call = Call.of("allgather", data, algorithm="ring")
    out, dims = comm._issue(lambda seq: comm._allgather(seq, data, call))
    parts = out.split(dims)
    return [pickle.loads(p.numpy().tobytes()) for p in parts]

"""Point-to-point messages and Python-object collectives, behind the Communicator's methods.

User messages get tags of their own: the top bit set (collective streams never set it),
the communicator's id, and the user's 32-bit tag, so they never meet a collective's.

Objects are pickled, like torch.distributed's and Horovod's object collectives: they travel
only between the job's own ranks, which run the same code. Nothing a server receives is
unpickled (servers use their own wire format).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from plait.comm import arguments, gathers, reductions
from plait.comm.backends.device_links import LaneRequest, StagedLink
from plait.comm.core.request import Request
from plait.comm.dispatch.runner import Runner
from plait.comm.transport.engine import Engine

_USER_TAG = 1 << 63
_MAX_USER_TAG = (1 << 32) - 1


def _p2p_args(runner: Runner, t: object, peer: object, tag: object, what: str) -> int:
    arguments.tensor(t, f"{what}'s tensor")
    if not isinstance(peer, int) or not 0 <= peer < runner.size or peer == runner.rank:
        raise ValueError(
            f"{what} peer must be another rank in [0, {runner.size}) (this is rank "
            f"{runner.rank}); got {peer!r}"
        )
    if not isinstance(tag, int) or not 0 <= tag <= _MAX_USER_TAG:
        raise ValueError(f"tag must be an int in [0, {_MAX_USER_TAG}]; got {tag!r}")
    if runner.engine.error is not None:
        raise runner.engine.error
    return _USER_TAG | (runner.id << 33) | tag


class AnySource(Request[None]):
    """A receive from whichever other rank's message under a tag comes first (MPI's
    MPI_ANY_SOURCE; torch's `recv` without `src`). The engine matches by (peer, tag), so
    `wait` makes progress until some peer's message has come (Engine.await_arrival), then
    receives it from that peer; `source` is that rank (-1 until then)."""

    def __init__(self, runner: Runner, tensor: torch.Tensor, tag: int) -> None:
        self._runner, self._buf = runner, tensor.view(-1)
        self._tag = _p2p_args(runner, tensor, (runner.rank + 1) % runner.size, tag, "recv")
        if not tensor.is_cpu or not tensor.is_contiguous():
            raise ValueError("a receive from any source takes a contiguous CPU tensor")
        self._peers = [runner.ranks[r] for r in range(runner.size) if r != runner.rank]
        self._inner: Request[None] | None = None
        self.source = -1

    def _match(self) -> bool:
        if self._inner is None:
            engine = self._runner.engine
            if engine.error is not None:
                raise engine.error
            peer = engine.arrived_from(self._peers, self._tag)
            if peer is None:
                return False
            self._inner = engine.irecv(self._buf, peer, self._tag)
            self.source = self._runner.ranks.index(peer)
        return True

    def done(self) -> bool:
        return self._match() and self._inner is not None and self._inner.done()

    def wait(self) -> None:
        self.arrive()
        assert self._inner is not None
        self._inner.wait()

    def arrive(self, until: Callable[[], bool] | None = None) -> bool:
        """Make progress until some peer's message has come (True: `wait` receives it), or
        until `until()` holds (False; checked whenever another thread wakes the engine)."""
        if self._inner is None:
            if self._runner.engine.await_arrival(self._peers, self._tag, until) is None:
                return False
            self._match()
        return True


def isend(
    runner: Runner, tensor: torch.Tensor, dst: int, tag: int = 0, ordered: bool = False
) -> Request[None]:
    """Start sending `tensor` to rank `dst`; don't modify it until `wait()`. `ordered`: see
    Communicator.isend."""
    full = _p2p_args(runner, tensor, dst, tag, "send")
    buf = tensor.contiguous().view(-1)
    lane = runner.lane(buf.device, runner.rank, dst) if ordered else None
    if lane is not None:
        return LaneRequest(runner.engine, lane, buf, dst, send=True)
    return _link(tensor, runner).isend(buf, runner.ranks[dst], full)


def irecv(
    runner: Runner, tensor: torch.Tensor, src: int, tag: int = 0, ordered: bool = False
) -> Request[None]:
    """Start receiving into `tensor` (contiguous, the sent size) from rank `src`."""
    full = _p2p_args(runner, tensor, src, tag, "recv")
    if not tensor.is_contiguous():
        raise ValueError("irecv needs a contiguous tensor (use recv, which copies for you)")
    lane = runner.lane(tensor.device, src, runner.rank) if ordered else None
    if lane is not None:
        return LaneRequest(runner.engine, lane, tensor.view(-1), src, send=False)
    return _link(tensor, runner).irecv(tensor.view(-1), runner.ranks[src], full)


def _link(tensor: torch.Tensor, runner: Runner) -> Engine | StagedLink:
    """The engine for CPU tensors; for GPU tensors, staged through host memory over it.

    Not NCCL: messages here are matched by tag, while NCCL matches point-to-point by order
    alone. Callers that receive in sending order say so (`ordered=True`), and their CUDA
    tensors go over NCCL lanes instead (runner.lane).
    """
    return runner.engine if tensor.is_cpu else StagedLink(runner.engine)


def send(
    runner: Runner, tensor: torch.Tensor, dst: int, tag: int = 0, ordered: bool = False
) -> None:
    """Send `tensor` to rank `dst` and wait until it is on its way."""
    isend(runner, tensor, dst, tag, ordered).wait()


def recv(
    runner: Runner, tensor: torch.Tensor, src: int, tag: int = 0, ordered: bool = False
) -> torch.Tensor:
    """Receive from rank `src` into `tensor` (its shape and dtype must match); return it."""
    arguments.tensor(tensor, "recv's tensor")  # before its methods are called
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    irecv(runner, buf, src, tag, ordered).wait()
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def broadcast_object(runner: Runner, obj: Any = None, root: int = 0) -> Any:
    """Return root's `obj` on every rank (pickled; job-internal only): its length, then
    its bytes, each a broadcast."""
    root = arguments.root(root, runner.size)
    if runner.rank == root:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    runner.run(reductions.broadcast(size, root, "auto", True, runner.size))
    if runner.rank != root:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    runner.run(reductions.broadcast(data, root, "auto", True, runner.size))
    return obj if runner.rank == root else pickle.loads(data.numpy().tobytes())


def allgather_object(runner: Runner, obj: Any) -> list[Any]:
    """Return every rank's `obj`, in rank order (pickled; job-internal only): one allgather
    of the bytes, whose lengths travel in its agreement exchange."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    out, dims = runner.run(gathers.allgather(data, "ring"))
    return [pickle.loads(p.numpy().tobytes()) for p in out.split(dims)]

"""The Communicator: a group of ranks and every collective, in Horovod's four forms.

Words: a *rank* is a position in this communicator (0..size-1); a *global rank* is a
position in the whole job; a *node* is a host (see core/topology.py). Collectives are called by
every rank of the communicator, in the same order.

Forms: `x` returns a new tensor and leaves its argument alone; `x_` works in place and
returns its argument; `x_async` and `x_async_` return a `Request` at once, whose `wait()`
returns what `x` or `x_` would (an in-place argument must not be touched until then).
Collectives whose result has another shape than their argument have no in-place form.

    collective      x / x_async                        x_ / x_async_
    allreduce       the reduction                      tensor, reduced
    broadcast       root's tensor                      tensor, overwritten with root's
    reduce          root: the reduction; others: None  root: tensor, reduced; others: None
    allgather       every rank's tensor, along dim 0   -
    reduce_scatter  this rank's block of the reduction -
    alltoall        what every rank sent here          -
    gather          root: every rank's; others: None   -
    scatter         this rank's part of root's tensor  -
    barrier         None                               -

Off the root, `reduce` and `gather` return None: there is no result there, and a
placeholder (an unchanged copy, say) would look like one to code run on the wrong rank.
It costs no copy, and it is torch.distributed's and MPI's convention (only the root's
receive buffer means anything). The argument of those ranks is left unchanged.

Which algorithm runs comes from the routing table (dispatch/routes.py); this class only
checks the arguments (reductions.py, gathers.py) and hands the call to its runner
(dispatch/runner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from plait import devices
from plait.comm import arguments, gathers, messaging, reductions, split
from plait.comm.backends import process_groups
from plait.comm.core.request import Request
from plait.comm.core.topology import Topology
from plait.comm.dispatch.runner import CallContext, Runner
from plait.comm.transport.arena import Arena
from plait.comm.transport.engine import Engine

if TYPE_CHECKING:
    from plait.trace.recorder import Recorder

Tensor = torch.Tensor
T = TypeVar("T")


class Communicator:
    """A group of ranks that run collectives together.

    Get the job-wide one from `plait.init()`; make smaller ones with `split`.
    """

    def __init__(
        self,
        engine: Engine,
        ranks: list[int],
        nodes: list[str],
        comm_id: int,
        pg: process_groups.Group | None = None,
    ) -> None:
        """Args:
        engine: the process's engine (shared by every communicator of the process).
        ranks: the global rank of each member, in communicator-rank order.
        nodes: the host of each member, in the same order.
        comm_id: 30 bits, the same on every member, unique in the job (the world's is 1).
        pg: the gloo group of these members, if one exists (else made on first use).
        """
        self.ranks = ranks
        self.topology = Topology(nodes, ranks.index(engine.rank))
        t = self.topology
        self.rank, self.size = t.rank, t.size
        self.local_rank, self.local_size = t.local_rank, t.local_size
        self.node_rank, self.num_nodes = t.node_rank, t.num_nodes
        self._runner = Runner(engine, ranks, t, comm_id, pg)

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, node_rank={self.node_rank}, "
            f"num_nodes={self.num_nodes})"
        )

    @property
    def engine(self) -> Engine:
        """The transport beneath (shared by every communicator of the process): its message
        counts and pipe switches are for tests and benchmarks."""
        return self._runner.engine

    @property
    def issued(self) -> int:
        """How many collective calls this communicator has issued (equal on every member
        between calls)."""
        return self._runner.seq

    @property
    def arenas(self) -> dict[str, Arena]:
        """The shared-memory segments made so far ("all": every rank; "local": this host's
        ranks), for tests and benchmarks."""
        return self._runner.arenas

    @property
    def recorder(self) -> Recorder | None:
        """The trace this communicator's collectives record into (plait.trace), or None."""
        return self._runner.recorder

    @recorder.setter
    def recorder(self, recorder: Recorder | None) -> None:
        self._runner.recorder = recorder

    @property
    def label(self) -> str:
        """How a trace names this communicator: "world" for the job's, else its members'
        global ranks ("0,2"), or what its maker named it (a torch group's description)."""
        return self._runner.label

    @label.setter
    def label(self, label: str) -> None:
        self._runner.label = label

    def run_call(self, fn: Callable[[CallContext], T], on: Tensor | None = None) -> T:
        """Run `fn`, composed from the front halves (reductions.py, gathers.py), as one
        collective (the torch backend's calls); `on`: its tensor, for CUDA streams."""
        return self._runner.run(fn, on=on)

    def start_call(self, fn: Callable[[CallContext], T], on: Tensor | None = None) -> Request[T]:
        """`run_call`, queued on the call thread; `wait()` returns its result."""
        return self._runner.start(fn, on=on)

    def close(self) -> None:
        """Stop the call thread of async calls (the engine stays: other communicators share it)."""
        self._runner.thread.stop()

    # ----------------------------------------------------------------- allreduce
    def allreduce(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Tensor:
        """Reduce `tensor` over all ranks; return the result as a new tensor on every rank.

        `check=False` skips the cross-rank agreement check for this call (one small message
        round fewer) where the caller has made sure every rank agrees, as DataParallel does
        for its buckets after the first step.
        """
        return self._runner.run(
            reductions.allreduce(arguments.copy(tensor), op, algorithm, check), on=tensor
        )

    def allreduce_(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Tensor:
        """Reduce `tensor` over all ranks in place; return it."""
        return self._runner.run(reductions.allreduce(tensor, op, algorithm, check), on=tensor)

    def allreduce_async(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """Start an allreduce into a new tensor; `wait()` returns it."""
        return self._runner.start(
            reductions.allreduce(arguments.copy(tensor), op, algorithm, check), on=tensor
        )

    def allreduce_async_(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """Start an in-place allreduce; `tensor` must not be touched until `wait()`."""
        return self._runner.start(reductions.allreduce(tensor, op, algorithm, check), on=tensor)

    # ------------------------------------------------------------------ broadcast
    def broadcast(
        self, tensor: Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> Tensor:
        """Return the root's `tensor` on every rank, as a new tensor (`check`: see allreduce)."""
        call = reductions.broadcast(arguments.copy(tensor), root, algorithm, check, self.size)
        return self._runner.run(call, on=tensor)

    def broadcast_(
        self, tensor: Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> Tensor:
        """Overwrite `tensor` with the root's, in place; return it."""
        return self._runner.run(
            reductions.broadcast(tensor, root, algorithm, check, self.size), on=tensor
        )

    def broadcast_async(
        self, tensor: Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """Start a broadcast into a new tensor; `wait()` returns it."""
        call = reductions.broadcast(arguments.copy(tensor), root, algorithm, check, self.size)
        return self._runner.start(call, on=tensor)

    def broadcast_async_(
        self, tensor: Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """Start an in-place broadcast; `tensor` must not be touched until `wait()`."""
        return self._runner.start(
            reductions.broadcast(tensor, root, algorithm, check, self.size), on=tensor
        )

    # --------------------------------------------------------------------- reduce
    def reduce(
        self, tensor: Tensor, root: int = 0, op: str = "sum", algorithm: str = "auto"
    ) -> Tensor | None:
        """Reduce onto `root`: the result as a new tensor there, None on the other ranks."""
        return self._runner.run(self._reduce(tensor, root, op, algorithm, False), on=tensor)

    def reduce_(
        self, tensor: Tensor, root: int = 0, op: str = "sum", algorithm: str = "auto"
    ) -> Tensor | None:
        """Reduce onto `root`, in place there (returns `tensor`); None on the other ranks,
        whose `tensor` is left unchanged."""
        return self._runner.run(self._reduce(tensor, root, op, algorithm, True), on=tensor)

    def reduce_async(
        self, tensor: Tensor, root: int = 0, op: str = "sum", algorithm: str = "auto"
    ) -> Request[Tensor | None]:
        """Start a reduce; `wait()` returns what `reduce` does."""
        return self._runner.start(self._reduce(tensor, root, op, algorithm, False), on=tensor)

    def reduce_async_(
        self, tensor: Tensor, root: int = 0, op: str = "sum", algorithm: str = "auto"
    ) -> Request[Tensor | None]:
        """Start an in-place reduce; `wait()` returns what `reduce_` does."""
        return self._runner.start(self._reduce(tensor, root, op, algorithm, True), on=tensor)

    def _reduce(
        self, tensor: Tensor, root: int, op: str, algorithm: str, in_place: bool
    ) -> Callable[[CallContext], Tensor | None]:
        return reductions.reduce(tensor, root, op, algorithm, self.size, in_place)

    # ------------------------------------------------------ gather-type collectives
    def allgather(
        self,
        tensor: Tensor,
        algorithm: str = "auto",
        *,
        out: Tensor | None = None,
        check: bool = True,
    ) -> Tensor:
        """Concatenate every rank's `tensor` along dim 0 (which may differ across ranks).

        `native` runs gloo's allgather when every rank's dim 0 is the same (gloo needs
        that) and plait's ring otherwise. `out`: gather into this tensor, of shape
        (size * dim 0, ...): every rank's block is then `tensor`'s shape, and `tensor` may
        be this rank's block of `out` (in place). `check=False` skips the exchange of shapes
        (see allreduce): every rank must then pass a tensor of this rank's shape.
        """
        if out is not None:
            out = arguments.gather_out(out, arguments.tensor(tensor), self.size)
        return self._runner.run(gathers.allgather(tensor, algorithm, check, out), on=tensor)[0]

    def allgather_async(
        self,
        tensor: Tensor,
        algorithm: str = "auto",
        *,
        out: Tensor | None = None,
        check: bool = True,
    ) -> Request[Tensor]:
        """Start an allgather; `wait()` returns what `allgather` does. With `out`, neither
        tensor may be touched until then."""
        if out is not None:
            out = arguments.gather_out(out, arguments.tensor(tensor), self.size)
        call = gathers.allgather(tensor, algorithm, check, out)
        return self._runner.start(lambda ctx: call(ctx)[0], on=tensor)

    def reduce_scatter(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Tensor:
        """Reduce over ranks and return this rank's part of dim 0 (split as torch.tensor_split).

        `native` runs gloo's when dim 0 divides evenly by the size (gloo needs that) and
        plait's ring otherwise. `check`: see allreduce.
        """
        return self._runner.run(gathers.reduce_scatter(tensor, op, algorithm, check), on=tensor)

    def reduce_scatter_async(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """Start a reduce-scatter; `wait()` returns what `reduce_scatter` does."""
        return self._runner.start(gathers.reduce_scatter(tensor, op, algorithm, check), on=tensor)

    def reduce_scatter_async_(
        self, tensor: Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Request[Tensor]:
        """`reduce_scatter_async` working in `tensor` itself (no copy): its contents are
        undefined once done but for this rank's block, which holds the result (a view of
        `tensor`), and it must not be touched until `wait()`."""
        call = gathers.reduce_scatter(tensor, op, algorithm, check, scratch=True)
        return self._runner.start(call, on=tensor)

    def alltoall(self, tensor: Tensor, splits: Sequence[int] | None = None) -> Tensor:
        """Send rows splits[j] of `tensor` (dim 0) to rank j; return what every rank sent here,
        concatenated in rank order. Without `splits`, dim 0 is split as torch.tensor_split."""
        return self._runner.run(gathers.alltoall(tensor, splits, self.size), on=tensor)

    def alltoall_async(
        self, tensor: Tensor, splits: Sequence[int] | None = None
    ) -> Request[Tensor]:
        """Start an alltoall; `wait()` returns what `alltoall` does."""
        return self._runner.start(gathers.alltoall(tensor, splits, self.size), on=tensor)

    def gather(self, tensor: Tensor, root: int = 0) -> Tensor | None:
        """Concatenate every rank's `tensor` along dim 0 on `root`; None on the other ranks."""
        return self._runner.run(gathers.gather(tensor, root, self.size), on=tensor)

    def gather_async(self, tensor: Tensor, root: int = 0) -> Request[Tensor | None]:
        """Start a gather; `wait()` returns what `gather` does."""
        return self._runner.start(gathers.gather(tensor, root, self.size), on=tensor)

    def scatter(self, tensor: Tensor | None, root: int = 0) -> Tensor:
        """Split root's `tensor` along dim 0 (as torch.tensor_split); rank j receives part j.
        Other ranks may pass None."""
        return self._runner.run(gathers.scatter(tensor, root, self.rank, self.size), on=tensor)

    def scatter_async(self, tensor: Tensor | None, root: int = 0) -> Request[Tensor]:
        """Start a scatter; `wait()` returns what `scatter` does."""
        return self._runner.start(gathers.scatter(tensor, root, self.rank, self.size), on=tensor)

    def barrier(self) -> None:
        """Return once every rank has called barrier."""
        self._runner.run(gathers.barrier())

    def barrier_async(self) -> Request[None]:
        """Start a barrier; `wait()` returns once every rank has called barrier."""
        return self._runner.start(gathers.barrier())

    # --------------------------------------------- point to point, Python objects
    def isend(
        self, tensor: Tensor, dst: int, tag: int = 0, *, ordered: bool = False
    ) -> Request[None]:
        """Start sending `tensor` to rank `dst`; don't modify it until `wait()`.

        `ordered=True` promises that `dst` receives this rank's ordered messages in the order
        they were sent, whatever their tags (and with `ordered=True` too): CUDA tensors then
        go over NCCL, which matches by order alone, on a lane of their own per direction, so
        that two ranks sending to each other cannot block each other (the pipeline's
        activations and gradients). Without it, CUDA tensors are staged through host memory
        and matched by tag. CPU tensors are unaffected.
        """
        return messaging.isend(self._runner, tensor, dst, tag, ordered)

    def irecv(
        self, tensor: Tensor, src: int, tag: int = 0, *, ordered: bool = False
    ) -> Request[None]:
        """Start receiving into `tensor` (contiguous, exactly the sent size) from `src`
        (`ordered`: see isend; the sender must have said the same)."""
        return messaging.irecv(self._runner, tensor, src, tag, ordered)

    def irecv_any(self, tensor: Tensor, tag: int = 0) -> messaging.AnySource:
        """`irecv` from whichever rank's message under `tag` comes first (CPU tensors);
        the request's `source` says which, once waited."""
        return messaging.AnySource(self._runner, tensor, tag)

    def send(self, tensor: Tensor, dst: int, tag: int = 0, *, ordered: bool = False) -> None:
        """Send `tensor` to rank `dst`; returns once it is on its way (`ordered`: see isend)."""
        messaging.send(self._runner, tensor, dst, tag, ordered)

    def recv(self, tensor: Tensor, src: int, tag: int = 0, *, ordered: bool = False) -> Tensor:
        """Receive from rank `src` into `tensor` (same size as sent); return it (`ordered`:
        see isend)."""
        return messaging.recv(self._runner, tensor, src, tag, ordered)

    def connect_lanes(self) -> None:
        """Connect the NCCL groups that ordered messages (`isend(..., ordered=True)`) of CUDA
        tensors on the job's GPU travel on. Every rank of the communicator calls it (the
        Pipeline does, when it is made); until then, and without NCCL, ordered messages are
        staged through host memory like the others."""
        self._runner.connect_lanes(devices.device())

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Return root's picklable `obj` on every rank."""
        return messaging.broadcast_object(self._runner, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable `obj`, in rank order."""
        return messaging.allgather_object(self._runner, obj)

    # ------------------------------------------------------------ sub-communicators
    def split(
        self,
        ranks: Sequence[int] | None = None,
        *,
        color: int | None = None,
        key: int = 0,
    ) -> Communicator | None:
        """Make sub-communicators. Every rank of this communicator must call it.

        `split(ranks=[0, 2])`: one new communicator of those ranks, in that order; ranks not
        in the list get None. `split(color=c, key=k)`: one communicator per colour, ordered by
        (key, rank); a rank passing color=None gets None (MPI_Comm_split).
        """
        seq = self._runner.seq  # before the split's own allgather: equal on every member
        found = split.members(self, ranks, color, key)
        if found is None:
            return None
        group, name = found
        return self._child(group, split.child_id(self._runner.id, seq, name, group))

    def subgroup(self, ranks: Sequence[int], comm_id: int) -> Communicator:
        """A communicator of `ranks` (of this one), made without a word to the others: its
        members agree on `comm_id` (30 bits, unique, not 1) by other means (torch's names)."""
        group = [int(r) for r in ranks]
        if self.rank not in group or not 1 < comm_id < 1 << 30:
            raise ValueError(f"subgroup: rank {self.rank} not in {group}, or comm_id {comm_id}")
        return self._child(group, comm_id)

    def _child(self, group: list[int], comm_id: int) -> Communicator:
        child = Communicator(
            self._runner.engine,
            [self.ranks[r] for r in group],
            [self.topology.nodes[r] for r in group],
            comm_id,
        )
        child.recorder = self.recorder  # one rank, one trace buffer
        return child

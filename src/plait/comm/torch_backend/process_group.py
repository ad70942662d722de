"""PlaitProcessGroup: the torch.distributed ProcessGroup of the "plait" backend.

torch calls one method per collective, with its own option structs (translate.py); each
method builds one plait call (collectives.py), issues it on this group's Communicator and
returns a PlaitWork (work.py). `opts.asyncOp` False (Python's `dist.x(...)` without
async_op) runs the call on the caller's thread with no hand-off; otherwise it queues on
the communicator's call thread, in issue order, as every rank does.

A Python subclass of ProcessGroup, not a C++ Backend (which Python cannot subclass): C++
callers (DDP's reducer, functional collectives) reach only the methods torch's trampoline
overrides (allreduce, allreduce_coalesced, allgather, all_gather_single_coalesced,
reduce_scatter, reduce_scatter_single_coalesced, all_to_all_single, broadcast, barrier,
send, recv, the group's name); Python callers (dist.*, FSDP2, DeviceMesh) find every
method by name.

The mismatch check (plait's exchange of call records, one small message round) runs on
the first call of each kind (method, op, dtype, device type), not on every call: DDP's
buckets and FSDP2's units are checked on the first step and then run with no extra round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.comm.dispatch.runner import CallContext
from plait.comm.torch_backend import collectives as C
from plait.comm.torch_backend import monitored
from plait.comm.torch_backend.translate import is_async, reduction, tensors
from plait.comm.torch_backend.work import PlaitWork, Waiter
from plait.errors import PlaitError

Tensor = torch.Tensor


class PlaitProcessGroup(dist.ProcessGroup):
    """One torch group over a plait Communicator (see the module docstring)."""

    def __init__(
        self, comm: Communicator, on_shutdown: Callable[[], None], timeout: float | None = None
    ) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        # new_group(timeout=) shorter than the engine's: each Work's wait is bounded by it
        # (the engine's own deadline, the job's, bounds every wait anyway)
        self._limit = timeout if timeout is not None and timeout < comm.engine.timeout else None
        self._name = ""
        self._desc = ""
        self._seen: set[tuple[object, ...]] = set()  # kinds of call checked already
        self._waiter = Waiter(f"plait-torch-waiter-{comm.rank}")
        self._on_shutdown = on_shutdown
        self._closed = False

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "plait"

    def name(self) -> str:
        return "plait"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc
        self.comm.label = desc  # how traces name the group: "default_pg", "mesh_dp", ...

    def _get_backend(self, device: Any) -> BackendStandIn:
        """What torch asks of the C++ backend beneath a group (a Python group has none):
        init_process_group(device_id=) asks whether it splits, FSDP2 whether it allocates."""
        return BackendStandIn()

    def __repr__(self) -> str:
        return (
            f"PlaitProcessGroup(rank={self.comm.rank}, size={self.comm.size}, name={self._name!r})"
        )

    # --------------------------------------------------------------- collectives
    # Each method: the call's kind (for the first-call check), its builder in collectives.py
    # with the builder's arguments (the `check` flag comes last), and the outputs.
    def allreduce(self, tensors_: Any, opts: Any = None, **kw: Any) -> PlaitWork:
        t = tensors(tensors_)[0]
        red = reduction(kw.get("op", opts))
        if t.is_sparse:  # gloo's sparse sum (DDP's sparse gradients): records always go
            return self._call(
                ("allreduce_sparse", red.op, t), C.sparse_allreduce, (t, red), [t], opts
            )
        return self._call(("allreduce", red.op, t), C.allreduce, (t, red), [t], opts)

    def allreduce_coalesced(self, tensors_: Sequence[Tensor], opts: Any = None) -> PlaitWork:
        ts, red = list(tensors_), reduction(opts)
        kind = ("allreduce_coalesced", red.op, ts[0] if ts else None)
        return self._call(kind, C.allreduce_coalesced, (ts, red), ts, opts)

    def broadcast(self, tensors_: Any, opts: Any = None, **kw: Any) -> PlaitWork:
        t = tensors(tensors_)[0]
        root = _root(opts, kw)
        return self._call(("broadcast", "-", t), C.broadcast, (t, root, self.size()), [t], opts)

    def reduce(self, tensors_: Any, opts: Any = None, **kw: Any) -> PlaitWork:
        t = tensors(tensors_)[0]
        root = _root(opts, kw)
        red = reduction(kw.get("op", None if isinstance(opts, int) else opts))
        args = (t, root, red, self.size())
        return self._call(("reduce", red.op, t), C.reduce, args, [t], opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> PlaitWork:
        ins = tensors(inputs)
        outs = [list(outputs)] if isinstance(outputs[0], Tensor) else [list(o) for o in outputs]
        return self._call(("allgather", "-", ins[0]), C.allgather_lists, (outs, ins), outs[0], opts)

    def allgather_coalesced(
        self, outputs: Any, inputs: Sequence[Tensor], opts: Any = None
    ) -> PlaitWork:
        # torch's outputs[j][k] is rank j's input k (allgather's list form is the other
        # way round: outputs[k][j])
        ins, by_rank = list(inputs), [list(o) for o in outputs]
        if any(len(o) != len(ins) for o in by_rank):
            raise ValueError(
                f"all_gather_coalesced: each output list must hold {len(ins)} tensors, one "
                f"per input; got lists of {[len(o) for o in by_rank]}"
            )
        outs = [[o[k] for o in by_rank] for k in range(len(ins))]
        every = [x for o in by_rank for x in o]
        kind = ("allgather_coalesced", "-", ins[0])
        return self._call(kind, C.allgather_lists, (outs, ins), every, opts)

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> PlaitWork:
        kind = ("allgather_into", "-", input)
        return self._call(kind, C.allgather_into, (output, input), [output], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], opts: Any = None
    ) -> PlaitWork:
        outs, ins = list(outputs), list(inputs)
        kind = ("allgather_into_coalesced", "-", ins[0])
        return self._call(kind, C.allgather_into_coalesced, (outs, ins), outs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> PlaitWork:
        outs = tensors(outputs)
        ins = [list(inputs)] if isinstance(inputs[0], Tensor) else [list(i) for i in inputs]
        red = reduction(opts)
        kind = ("reduce_scatter", red.op, outs[0])
        return self._call(kind, C.reduce_scatter_lists, (outs, ins, red), outs, opts)

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> PlaitWork:
        red = reduction(opts)
        kind = ("reduce_scatter_into", red.op, input)
        return self._call(kind, C.reduce_scatter_into, (output, input, red), [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], opts: Any = None
    ) -> PlaitWork:
        outs, ins, red = list(outputs), list(inputs), reduction(opts)
        kind = ("reduce_scatter_into_coalesced", red.op, ins[0])
        return self._call(kind, C.reduce_scatter_into_coalesced, (outs, ins, red), outs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: Sequence[int] = (),
        input_split_sizes: Sequence[int] = (),
        opts: Any = None,
    ) -> PlaitWork:
        splits = (list(output_split_sizes), list(input_split_sizes))
        args = (output, input, *splits, self.size())
        return self._call(("alltoall", "-", input), C.alltoall_single, args, [output], opts)

    alltoall_base = all_to_all_single

    def alltoall(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], opts: Any = None
    ) -> PlaitWork:
        outs, ins = list(outputs), list(inputs)
        return self._call(("alltoall", "-", ins[0]), C.alltoall, (outs, ins), outs, opts)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> PlaitWork:
        t = tensors(inputs)[0]
        outs = list(outputs[0]) if len(outputs) else []
        args = (outs, t, _root(opts, {}), self.rank())
        return self._call(("gather", "-", t), C.gather, args, outs, opts)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> PlaitWork:
        out = tensors(outputs)[0]
        ins = list(inputs[0]) if len(inputs) else []
        args = (out, ins, _root(opts, {}), self.rank())
        return self._call(("scatter", "-", out), C.scatter, args, [out], opts)

    def barrier(self, opts: Any = None, **kw: Any) -> PlaitWork:
        return self._call(("barrier", "-", None), C.barrier, (), [], opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's: rank 0 names the ranks that did not come within `timeout`."""
        monitored.monitored_barrier(self.comm, timeout, wait_all_ranks)

    # ---------------------------------------------------------- point to point
    def send(self, tensors_: Any, dstRank: int, tag: int = 0) -> PlaitWork:
        t = tensors(tensors_)[0]
        return self._p2p(lambda: self.comm.isend(t.contiguous(), dstRank, tag), [t])

    def recv(self, tensors_: Any, srcRank: int, tag: int = 0) -> PlaitWork:
        t = tensors(tensors_)[0]
        if not t.is_contiguous():
            raise ValueError("recv: the plait backend receives into contiguous tensors only")
        return self._p2p(lambda: self.comm.irecv(t, srcRank, tag), [t])

    def recv_anysource(self, tensors_: Any, tag: int = 0) -> PlaitWork:
        """`dist.recv` without `src`: the first message under `tag` from any rank; the
        Work's source rank says whose (CPU tensors)."""
        t = tensors(tensors_)[0]
        return self._p2p(lambda: self.comm.irecv_any(t, tag), [t])

    # -------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """destroy_process_group: stop this group's threads, and let go of the engine
        (the default group; plait.shutdown() too, if plait.init() was called)."""
        if self._closed:
            return
        self.close()
        self._closed = True
        self._on_shutdown()

    def close(self) -> None:
        """Stop this group's threads (the engine's closing does it too, first)."""
        self._waiter.stop()
        self.comm.close()

    def abort(self) -> None:
        self.comm.engine.abort("the torch process group was aborted")
        self.shutdown()

    # ----------------------------------------------------------------- helpers
    def _call(
        self,
        key: tuple[str, str, Tensor | None],
        build: Callable[..., Callable[[CallContext], list[Tensor]]],
        args: tuple[Any, ...],
        outputs: list[Tensor],
        opts: Any,
    ) -> PlaitWork:
        method, op, t = key
        kind = (method, op) if t is None else (method, op, t.dtype, t.device.type)
        check = kind not in self._seen
        if check:
            self._seen.add(kind)
        # argument errors raise here, on every rank alike, before any message
        fn = build(*args, check)
        on = t if t is not None and t.is_cuda else None
        try:
            if not is_async(opts) and self._limit is None:
                self.comm.run_call(fn, on)
                return PlaitWork(None, outputs)
            request = self.comm.start_call(fn, on)
            return PlaitWork(request, outputs, self._waiter, limit=self._limit)
        except PlaitError as e:  # a peer had failed: say so through the Work, as torch's do
            return PlaitWork.failed(e)

    def _p2p(self, post: Callable[[], Request[None]], outputs: list[Tensor]) -> PlaitWork:
        try:
            return PlaitWork(post(), outputs, self._waiter, limit=self._limit)
        except PlaitError as e:
            return PlaitWork.failed(e)


def _root(opts: Any, kw: dict[str, Any]) -> int:
    """The root rank: from torch's options struct, or the user form's int / `root=`."""
    if isinstance(opts, int):
        return opts
    return int(kw.get("root", getattr(opts, "rootRank", 0)))


class BackendStandIn:
    """The answers torch 2.13's Python code reads from `pg._get_backend(device)`: plait
    splits no communicator eagerly, coalesces nothing, allocates no special memory."""

    supports_splitting = False
    supports_coalescing = False

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def name(self) -> str:
        return "plait"

    def _set_sequence_number_for_group(self) -> None:
        pass  # plait's sequence numbers are its communicators' own

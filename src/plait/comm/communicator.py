"""The Communicator: ranks, topology, and every collective, over plait's engine or gloo.

Words: a *rank* is a position in this communicator (0..size-1); a *global rank* is a
position in the whole job; a *node* is a host (ranks with the same PLAIT_NODE_ID or
hostname). Collectives are called by every rank of the communicator, in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from plait.comm import messaging, native, select, shm, split
from plait.comm.algorithms import direct, halving_doubling, hierarchical, ring, tree
from plait.comm.calls import Call, agree, check_enabled, dtype_from_name, dtype_name, record_bytes
from plait.comm.engine import Engine
from plait.comm.frames import Request
from plait.comm.handle import Handle, Worker
from plait.comm.ops import check_op, finish_avg
from plait.errors import PlaitError

T = TypeVar("T")

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "native", "ring", "halving_doubling", "tree", "shm", "hierarchical"),
    "broadcast": ("auto", "native", "tree", "shm"),
    "reduce": ("auto", "native", "tree"),
    "allgather": ("auto", "native", "ring", "shm", "hierarchical"),
    "reduce_scatter": ("auto", "native", "ring", "shm", "hierarchical"),
}


class _Channel:
    """One collective call's private message stream (see comm/p2p.py)."""

    __slots__ = ("_engine", "_ranks", "_tag", "rank", "size")

    def __init__(self, engine: Engine, ranks: list[int], rank: int, tag: int) -> None:
        self._engine, self._ranks, self._tag = engine, ranks, tag
        self.rank, self.size = rank, len(ranks)

    def isend(self, buf: torch.Tensor, peer: int) -> Request:
        return self._engine.isend(buf, self._ranks[peer], self._tag)

    def irecv(self, buf: torch.Tensor, peer: int) -> Request:
        return self._engine.irecv(buf, self._ranks[peer], self._tag)


def _tensor(t: object, name: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    dtype_name(t.dtype)  # raises TypeError for unsupported dtypes
    return t


def _algorithm(kind: str, algorithm: str) -> str:
    if algorithm not in ALGORITHMS[kind]:
        accepted = ", ".join(map(repr, ALGORITHMS[kind]))
        raise ValueError(f"{kind} algorithm must be one of {accepted}; got {algorithm!r}")
    return algorithm


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, detached from autograd: collectives are not differentiable here."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


def _rows(shape: Sequence[int]) -> int:
    """Elements per row (everything after the first dimension)."""
    n = 1
    for d in shape[1:]:
        n *= d
    return n


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
        pg: native.Group | None = None,
    ) -> None:
        self._engine = engine
        self.ranks = ranks  # global rank of each member
        self.rank = ranks.index(engine.rank)
        self.size = len(ranks)
        self._nodes = nodes
        order = list(dict.fromkeys(nodes))  # nodes in order of their lowest rank
        self.node_rank = order.index(nodes[self.rank])
        self.num_nodes = len(order)
        self.local_rank = nodes[: self.rank].count(nodes[self.rank])
        self.local_size = nodes.count(nodes[self.rank])
        # each host's ranks, hosts in node_rank order (for the hierarchical algorithms)
        self._hosts = [[i for i, n in enumerate(nodes) if n == h] for h in order]
        self._id = comm_id
        self._pg = pg
        self._seq = 0
        self._seq_lock = threading.Lock()  # a lost update would desynchronise the ranks
        self._worker = Worker(f"plait-comm-{comm_id}")
        # shared-memory segments, made by the first collective that needs one: "all" (every
        # rank on one host) and "local" (this host's ranks, for the hierarchical allreduce)
        self._arenas: dict[str, shm.Arena] = {}

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, node_rank={self.node_rank}, "
            f"num_nodes={self.num_nodes})"
        )

    # ------------------------------------------------------------------ machinery
    def _channel(self, seq: int, sub: int, members: list[int] | None = None) -> _Channel:
        """Call `seq`'s message stream `sub` (< 8), over every rank or only `members`
        (communicator ranks, this one among them; renumbered 0.. in that order)."""
        # 30-bit id, 30 bits of seq (calls 2^30 apart never overlap), 3 of stream: 63 bits
        tag = (self._id << 33) | ((seq & 0x3FFFFFFF) << 3) | sub
        if members is None:
            return _Channel(self._engine, self.ranks, self.rank, tag)
        ranks = [self.ranks[m] for m in members]
        return _Channel(self._engine, ranks, members.index(self.rank), tag)

    def _issue(self, fn: Callable[[int], T], async_op: bool = False) -> Any:
        """Give the call its sequence number now; run it inline, or after queued async calls."""
        if self._engine.error is not None:
            raise self._engine.error
        with self._seq_lock:
            seq = self._seq
            self._seq += 1

        def call() -> T:
            try:
                with torch.no_grad():  # per thread: the async worker needs it too
                    return fn(seq)
            except PlaitError:
                raise  # raised alike on every rank (mismatch), or a peer's failure
            except Exception as e:  # only here: the peers are mid-call and would wait
                self._engine.abort(f"raised {type(e).__name__} inside a collective: {e}")
                raise

        if async_op:
            return self._worker.submit(call)
        if self._worker.idle:
            return call()
        return self._worker.submit(call).wait()

    def _exchange(
        self, seq: int, call: Call, needed: bool = False, check: bool = True
    ) -> list[Call] | None:
        """Share every rank's call; raise CollectiveMismatchError on disagreement.

        Skipped unless the call `needed` the others' records (shapes), or `check` (the
        caller's) and PLAIT_CHECK both ask for it.
        """
        if self.size == 1 or not (needed or (check and check_enabled())):
            return None
        n = record_bytes(self.size)
        mine = torch.frombuffer(bytearray(call.encode(self.size)), dtype=torch.uint8)
        blocks = [torch.empty(n, dtype=torch.uint8) for _ in range(self.size)]
        direct.allgather_small(self._channel(seq, 0), mine, blocks)
        calls = [Call.decode(b.numpy().tobytes()) for b in blocks]
        agree(calls)
        return calls

    def _arena(self, seq: int, nbytes: int, members: list[int] | None = None) -> shm.Arena:
        """The shared-memory segment of every rank (or of `members`, this host's ranks),
        created or grown collectively to fit `nbytes`."""
        which = "all" if members is None else "local"
        size, hosts = (self.size, self.num_nodes) if members is None else (len(members), 1)
        if not shm.available(size, hosts):
            raise shm.ShmError(
                f"algorithm 'shm' needs every rank on one host (x86-64 with {shm.SHM_DIR}); "
                f"this communicator spans {self.num_nodes} hosts"
            )
        want = shm.slot_bytes_for(nbytes)
        arena = self._arenas.get(which)
        if arena is None or arena.slot_bytes < want:
            if arena is not None:
                arena.close()
            ch = self._channel(seq, 2, members)
            arena = shm.Arena.create(self._engine, ch, want, f"{self._id}-{seq}-{which}")
            self._arenas[which] = arena
        return arena

    def _levels(self) -> tuple[list[int], list[int]] | None:
        """(this host's ranks, the ranks of this local rank on every host), as communicator
        ranks in order, for the hierarchical allreduce; None unless there are several hosts
        with the same number (> 1) of ranks each."""
        hosts = self._hosts
        sizes = {len(h) for h in hosts}
        if len(hosts) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        local = hosts[self.node_rank]
        return local, [h[self.local_rank] for h in hosts]

    def _native_group(self) -> native.Group:
        if self._pg is None:  # sub-communicators create their gloo group on first native use
            self._pg = native.new_group(self._id, self.rank, self.size, self._engine.timeout)
        return self._pg

    def _native(self, what: str, start: Callable[[native.Group], dist.Work]) -> None:
        group = self._native_group()
        native.run(self._engine, what, lambda: start(group))

    # ----------------------------------------------------------------- allreduce
    def allreduce(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> torch.Tensor:
        """Reduce `tensor` over all ranks; return the result as a new tensor on every rank.

        `check=False` skips the cross-rank agreement check for this call (one small message
        round fewer) where the caller has made sure every rank agrees, as DataParallel does
        for its buckets after the first step.
        """
        return self.allreduce_(_copy(_tensor(tensor)), op, algorithm, check=check)

    def allreduce_(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> torch.Tensor:
        """Reduce `tensor` over all ranks in place; return it."""
        return self._issue(self._allreduce_fn(tensor, op, algorithm, check))

    def allreduce_async(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Handle[torch.Tensor]:
        """Start an allreduce into a new tensor; `handle.wait()` returns it."""
        return self.allreduce_async_(_copy(_tensor(tensor)), op, algorithm, check=check)

    def allreduce_async_(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", *, check: bool = True
    ) -> Handle[torch.Tensor]:
        """Start an in-place allreduce; `tensor` must not be touched until `wait()`."""
        return self._issue(self._allreduce_fn(tensor, op, algorithm, check), async_op=True)

    def _allreduce_fn(
        self, tensor: torch.Tensor, op: str, algorithm: str, check: bool = True
    ) -> Callable[[int], torch.Tensor]:
        t, op, algorithm = (
            _tensor(tensor),
            check_op(op, _tensor(tensor).dtype),
            _algorithm("allreduce", algorithm),
        )
        call = Call.of("allreduce", t, op=op, algorithm=algorithm)

        def run(seq: int) -> torch.Tensor:
            self._exchange(seq, call, check=check)
            if self.size == 1 or t.numel() == 0:
                return t
            buf = t if t.is_contiguous() else t.contiguous()
            name = algorithm
            if name == "auto":
                name = select.allreduce(buf.numel() * buf.element_size(), self)
            base = "sum" if op == "avg" else op
            if name == "native":
                self._native("allreduce", lambda g: native.allreduce(g, buf, op))
            elif name == "shm":
                nbytes = buf.numel() * buf.element_size()
                shm.allreduce(self._arena(seq, nbytes), _flat(buf), base)
            elif name == "hierarchical":
                self._hierarchical(seq, _flat(buf), base)
            else:
                ch = self._channel(seq, 1)
                if name == "ring":
                    ring.allreduce(ch, _flat(buf), base)
                elif name == "halving_doubling":
                    halving_doubling.allreduce(ch, _flat(buf), base)
                else:
                    tree.allreduce(ch, _flat(buf), base)
            if op == "avg":
                finish_avg(buf, self.size)
            if buf is not t:
                t.copy_(buf)
            return t

        return run

    def _two_levels(self, nbytes: int, seq: int) -> tuple[shm.Arena, _Channel, list[list[int]]]:
        """This host's shared-memory arena, the channel to this local rank's peers on the
        other hosts, and every host's ranks; raises ShmError where there are no two levels."""
        levels = self._levels()
        if levels is None:
            raise shm.ShmError(
                "algorithm 'hierarchical' needs ranks on several hosts with the same number "
                f"(> 1) of ranks each; this communicator has {self.num_nodes} host(s) with "
                f"{[len(h) for h in self._hosts]} ranks"
            )
        local, cross = levels
        return self._arena(seq, nbytes, local), self._channel(seq, 3, cross), self._hosts

    def _hierarchical(self, seq: int, buf: torch.Tensor, op: str) -> None:
        arena, cross, hosts = self._two_levels(buf.numel() * buf.element_size(), seq)
        part_bytes = min(buf.numel() * buf.element_size(), arena.slot_bytes)
        across = select.cross_allreduce(part_bytes // len(hosts[0]), len(hosts))
        hierarchical.allreduce(arena, cross, buf, op, across)

    # ------------------------------------------------------- broadcast and reduce
    def broadcast(
        self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> torch.Tensor:
        """Return the root's `tensor` on every rank, as a new tensor (`check`: see allreduce)."""
        return self.broadcast_(_copy(_tensor(tensor)), root, algorithm, check=check)

    def broadcast_(
        self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto", *, check: bool = True
    ) -> torch.Tensor:
        """Overwrite `tensor` with the root's, in place; return it."""
        t, algorithm = _tensor(tensor), _algorithm("broadcast", algorithm)
        root = self._root(root)
        call = Call.of("broadcast", t, root=root, algorithm=algorithm)

        def run(seq: int) -> torch.Tensor:
            self._exchange(seq, call, check=check)
            if self.size == 1 or t.numel() == 0:
                return t
            buf = t if t.is_contiguous() else t.contiguous()
            name = (
                algorithm
                if algorithm != "auto"
                else select.broadcast(buf.numel() * buf.element_size(), self)
            )
            if name == "native":
                self._native("broadcast", lambda g: native.broadcast(g, buf, root))
            elif name == "shm":
                nbytes = buf.numel() * buf.element_size()
                shm.broadcast(self._arena(seq, nbytes), _flat(buf), root)
            else:
                tree.broadcast(self._channel(seq, 1), _flat(buf), root)
            if buf is not t:
                t.copy_(buf)
            return t

        return self._issue(run)

    def reduce(
        self, tensor: torch.Tensor, root: int = 0, op: str = "sum", algorithm: str = "auto"
    ) -> torch.Tensor:
        """Reduce onto `root`. Returns the result on root, an unchanged copy elsewhere."""
        t, op, algorithm = (
            _tensor(tensor),
            check_op(op, _tensor(tensor).dtype),
            _algorithm("reduce", algorithm),
        )
        root = self._root(root)
        call = Call.of("reduce", t, op=op, root=root, algorithm=algorithm)

        def run(seq: int) -> torch.Tensor:
            self._exchange(seq, call)
            buf = _copy(t)  # the result on root; scratch elsewhere
            if self.size == 1 or t.numel() == 0:
                return buf
            name = (
                algorithm
                if algorithm != "auto"
                else select.reduce(buf.numel() * buf.element_size(), self)
            )
            if name == "native":
                self._native("reduce", lambda g: native.reduce(g, buf, op, root))
            else:
                tree.reduce(self._channel(seq, 1), _flat(buf), "sum" if op == "avg" else op, root)
            if self.rank != root:
                return _copy(t)
            if op == "avg":
                finish_avg(buf, self.size)
            return buf

        return self._issue(run)

    def _root(self, root: object) -> int:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise ValueError(f"root must be an int rank in [0, {self.size}); got {root!r}")
        return root

    # ------------------------------------------------------ gather-type collectives
    def allgather(self, tensor: torch.Tensor, algorithm: str = "auto") -> torch.Tensor:
        """Concatenate every rank's `tensor` along dim 0 (which may differ across ranks).

        `auto` runs plait's ring; `native` runs gloo's allgather when every rank's dim 0 is the
        same (gloo needs that) and the ring otherwise.
        """
        t, algorithm = _tensor(tensor), _algorithm("allgather", algorithm)
        if t.dim() == 0:
            raise ValueError("allgather needs a tensor with at least one dimension; got a scalar")
        call = Call.of("allgather", t, algorithm=algorithm)
        return self._issue(lambda seq: self._allgather(seq, t, call)[0])

    def _allgather(self, seq: int, t: torch.Tensor, call: Call) -> tuple[torch.Tensor, list[int]]:
        calls = self._exchange(seq, call, needed=True)
        if calls is None:
            return t.clone(memory_format=torch.contiguous_format), [t.shape[0]]
        dims = [c.shape[0] for c in calls]
        row = _rows(t.shape)
        bounds = [0]
        for d in dims:
            bounds.append(bounds[-1] + d * row)
        out = torch.empty((sum(dims), *t.shape[1:]), dtype=t.dtype)
        flat = _flat(out)
        flat[bounds[self.rank] : bounds[self.rank + 1]] = t.reshape(-1)
        name = self._gather_kind(call.algorithm)
        if name == "native" and len(set(dims)) == 1:
            parts = list(out.chunk(self.size)) if dims[0] else []
            if parts:
                mine = t.contiguous()
                self._native("allgather", lambda g: native.allgather(g, parts, mine))
        elif not flat.numel():
            pass
        elif name == "shm":
            shm.allgather(self._arena(seq, flat.numel() * flat.element_size()), flat, bounds)
        elif name == "hierarchical":
            local, cross, hosts = self._two_levels(flat.numel() * flat.element_size(), seq)
            hierarchical.allgather(local, cross, flat, bounds, hosts)
        else:
            ring.allgather(self._channel(seq, 1), flat, bounds)
        return out, dims

    def _gather_kind(self, algorithm: str) -> str:
        """allgather / reduce_scatter: what `auto` means here (shm on one host, the two
        levels across equal hosts, else the ring)."""
        if algorithm != "auto":
            return algorithm
        if shm.available(self.size, self.num_nodes):
            return "shm"
        return "hierarchical" if self._levels() is not None else "ring"

    def reduce_scatter(
        self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto"
    ) -> torch.Tensor:
        """Reduce over ranks and return this rank's part of dim 0 (split as torch.tensor_split).

        `auto` runs plait's ring; `native` runs gloo's when dim 0 divides evenly by the size
        (gloo needs that) and the ring otherwise.
        """
        t, op, algorithm = (
            _tensor(tensor),
            check_op(op, _tensor(tensor).dtype),
            _algorithm("reduce_scatter", algorithm),
        )
        if t.dim() == 0:
            raise ValueError(
                "reduce_scatter needs a tensor with at least one dimension; got a scalar"
            )
        call = Call.of("reduce_scatter", t, op=op, algorithm=algorithm)

        def run(seq: int) -> torch.Tensor:
            self._exchange(seq, call)
            rows = ring.bounds_even(t.shape[0], self.size)
            lo, hi = rows[self.rank], rows[self.rank + 1]
            buf = t.clone(memory_format=torch.contiguous_format)
            name = self._gather_kind(algorithm)
            base = "sum" if op == "avg" else op
            row = _rows(t.shape)
            if self.size > 1 and buf.numel() and name in ("shm", "hierarchical"):
                flat, elems = _flat(buf), [r * row for r in rows]
                nbytes = flat.numel() * flat.element_size()
                if name == "shm":
                    shm.reduce_scatter(self._arena(seq, nbytes), flat, base, elems)
                    mine = flat[elems[self.rank] : elems[self.rank + 1]].clone()
                else:
                    local, cross, hosts = self._two_levels(nbytes, seq)
                    mine = hierarchical.reduce_scatter(local, cross, flat, base, elems, hosts)
                buf = mine.view(hi - lo, *t.shape[1:])
            elif self.size > 1 and buf.numel():
                even = t.shape[0] % self.size == 0
                if name == "native" and even:
                    out = torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype)
                    parts = list(buf.chunk(self.size))
                    self._native(
                        "reduce_scatter", lambda g: native.reduce_scatter(g, out, parts, op)
                    )
                    buf = out
                else:
                    ring.reduce_scatter(
                        self._channel(seq, 1), _flat(buf), base, [r * row for r in rows]
                    )
                    buf = buf[lo:hi].clone()
            else:
                buf = buf[lo:hi].clone()
            if op == "avg":
                finish_avg(buf, self.size)
            return buf

        return self._issue(run)

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = None) -> torch.Tensor:
        """Send rows splits[j] of `tensor` (dim 0) to rank j; return what every rank sent here,
        concatenated in rank order. Without `splits`, dim 0 is split as torch.tensor_split."""
        t = _tensor(tensor)
        if t.dim() == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension; got a scalar")
        if splits is None:
            bounds = ring.bounds_even(t.shape[0], self.size)
            sizes = [bounds[i + 1] - bounds[i] for i in range(self.size)]
        else:
            sizes = [
                int(s) if isinstance(s, int) and not isinstance(s, bool) else -1 for s in splits
            ]
            if len(sizes) != self.size or min(sizes, default=0) < 0 or sum(sizes) != t.shape[0]:
                raise ValueError(
                    f"splits must be {self.size} non-negative ints summing to dim 0 "
                    f"({t.shape[0]}); got {list(splits)}"
                )
        call = Call.of("alltoall", t, splits=tuple(sizes))

        def run(seq: int) -> torch.Tensor:
            calls = self._exchange(seq, call, needed=True)
            got = [c.splits[self.rank] for c in calls] if calls else sizes
            out = torch.empty((sum(got), *t.shape[1:]), dtype=t.dtype)
            send = list(t.contiguous().split(sizes))
            recv = list(out.split(got))
            if calls is None:
                out.copy_(t)
            else:
                direct.alltoall(
                    self._channel(seq, 1), [_flat(s) for s in send], [_flat(r) for r in recv]
                )
            return out

        return self._issue(run)

    def gather(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's `tensor` along dim 0 on `root`; None on the other ranks."""
        t, root = _tensor(tensor), self._root(root)
        if t.dim() == 0:
            raise ValueError("gather needs a tensor with at least one dimension; got a scalar")
        call = Call.of("gather", t, root=root)

        def run(seq: int) -> torch.Tensor | None:
            calls = self._exchange(seq, call, needed=True)
            if calls is None:
                return t.clone(memory_format=torch.contiguous_format)
            dims = [c.shape[0] for c in calls]
            out = (
                torch.empty((sum(dims), *t.shape[1:]), dtype=t.dtype) if self.rank == root else None
            )
            blocks = [_flat(b) for b in out.split(dims)] if out is not None else []
            direct.gather(self._channel(seq, 1), _flat(t.contiguous()), blocks, root)
            return out

        return self._issue(run)

    def scatter(self, tensor: torch.Tensor | None, root: int = 0) -> torch.Tensor:
        """Split root's `tensor` along dim 0 (as torch.tensor_split); rank j receives part j.
        Other ranks may pass None."""
        root = self._root(root)
        t = _tensor(tensor) if self.rank == root else None
        if t is not None and t.dim() == 0:
            raise ValueError("scatter needs a tensor with at least one dimension; got a scalar")
        call = Call.of("scatter", t, root=root)

        def run(seq: int) -> torch.Tensor:
            calls = self._exchange(seq, call, needed=True)
            if calls is None:
                assert t is not None
                return t.clone(memory_format=torch.contiguous_format)
            shape, dtype = calls[root].shape, dtype_from_name(calls[root].dtype)
            rows = ring.bounds_even(shape[0], self.size)
            out = torch.empty((rows[self.rank + 1] - rows[self.rank], *shape[1:]), dtype=dtype)
            blocks = []
            if t is not None:
                sizes = [rows[i + 1] - rows[i] for i in range(self.size)]
                blocks = [_flat(b) for b in t.contiguous().split(sizes)]
            direct.scatter(self._channel(seq, 1), blocks, _flat(out), root)
            return out

        return self._issue(run)

    def barrier(self) -> None:
        """Return once every rank has called barrier."""

        def run(seq: int) -> None:
            if self._exchange(seq, Call("barrier")) is None and self.size > 1:
                direct.barrier(self._channel(seq, 1))

        self._issue(run)

    # --------------------------------------------- point to point, Python objects
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending `tensor` to rank `dst`; don't modify it until `wait()`."""
        return messaging.isend(self, tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into `tensor` (contiguous, exactly the sent size) from `src`."""
        return messaging.irecv(self, tensor, src, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send `tensor` to rank `dst`; returns once it is on its way."""
        messaging.send(self, tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive from rank `src` into `tensor` (same size as sent); return it."""
        return messaging.recv(self, tensor, src, tag)

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Return root's picklable `obj` on every rank."""
        return messaging.broadcast_object(self, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's picklable `obj`, in rank order."""
        return messaging.allgather_object(self, obj)

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
        return split.split(self, ranks, color, key)

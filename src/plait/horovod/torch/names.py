"""Named operations meet by name: Horovod's negotiation, without its cycle.

Horovod 0.28 (horovod/common/operations.cc, controller.cc, tensor_queue.cc): every
operation a rank posts goes into its tensor queue under a name, `allreduce.<name>` (the
prefix is the op's: allgather, broadcast, reducescatter, alltoall, grouped_...), or
`allreduce.noname.<handle>` when the script gave none (horovod/torch/mpi_ops_v2.cc). A
background thread runs a negotiation cycle every HOROVOD_CYCLE_TIME: each rank tells the
coordinator (rank 0) which names it has posted since, the coordinator answers with those
that every rank has posted, and all ranks run them in the order of its answer. So named
operations may be posted in different orders on different ranks. A name posted again while
the first is still in the queue fails at once on the posting rank, with InvalidArgument
("... a tensor with the same name as another tensor that is currently being processed"),
ValueError in Python; the name is free again once its operation has run. Unnamed
operations are named by the handle counter, so they meet only when every rank posts them in
the same order, which is what plait's order matching gives them for free (they stay there).

Here each process set's named operations travel on a communicator of their own beside the
ordered one, so they pass unnamed and blocking calls in either direction, and rank 0 of the
set is the sequencer, driven by events instead of a cycle:

    other ranks   post X: send hash(X) (8 bytes) to rank 0; while they have named ops
                  waiting, receive rank 0's next decision and run that op
    rank 0        post X; while it has named ops waiting, take the others' announcements
                  as they come; each name that every rank has posted is decided: its hash
                  goes to every rank, then rank 0 runs it

A decision names only an op every rank has posted, and every rank runs the decisions in
rank 0's order, so the named communicator still matches by order, and its call check still
compares what each rank passed under one name. Per named op: one 16-byte message to rank 0
from each other rank, one back, then the collective. An op whose name some rank never posts
waits (PLAIT_TIMEOUT), as Horovod's stalls; one that can finish is never held up by one
that cannot.

hvd.join(): a rank that joins tells rank 0 (JOINED) and serves the named ops decided
meanwhile as it serves the ordered ones (join.py: zeros for allreduce, the others refused):
rank 0 decides a name once every rank that has not joined posted it, and says in the
decision that some rank has joined, so that every rank runs it in join mode (a join.agree
round before each collective of the op). When every rank has joined, join() returns on all;
each rank then says so to rank 0 (UNJOINED), which answers END, and join() waits for that
before it returns, so that no name posted after it is decided under the old membership.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.comm.core.request import Future
from plait.comm.dispatch.call_thread import CallThread
from plait.errors import PlaitError
from plait.horovod.torch import join as joining

_ANNOUNCE, _DECIDE = 1, 2  # message tags on the named communicator
# announcements and decisions are [hash or one of these, rounds, in join mode]
_JOINED, _UNJOINED, _END = -1, -2, -3
Run = Callable[[Communicator, bool], Any]  # runs a posted op list (True: in join mode)


def key(prefix: str, name: str | None) -> str | None:
    """Horovod's name of an op: `allreduce.<name>` (None: an unnamed op, matched by order)."""
    return None if name is None else f"{prefix}.{name}"


def digest(op_key: str) -> int:
    """The 63-bit number that stands for `op_key` on the wire."""
    return int.from_bytes(hashlib.blake2b(op_key.encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class _Posted:
    key: str
    run: Run
    future: Future[Any] = field(default_factory=Future)


class NameTable:
    """The named ops of one process set: posted, negotiated with rank 0, run in its order."""

    def __init__(self, comm: Communicator, label: str) -> None:
        self.comm = comm  # the named ops' own communicator (the same ranks as the ordered one)
        self._worker = CallThread(f"plait-hvd-names-{label}")
        self._lock = threading.Lock()
        self._waiting: dict[int, _Posted] = {}  # posted here, not run yet; in posting order
        self._serving = False  # a serve loop is queued or running on the worker
        self._sends: list[Any] = []  # messages on their way (their buffers live here)
        # rank 0: which others posted each name, and how many collectives it makes
        self._announced: dict[int, set[int]] = {}
        self._rounds: dict[int, int] = {}
        self._joined: set[int] = set()  # rank 0: the ranks in hvd.join()
        self._left = 0  # rank 0: the others that have left the join that ends now
        self._joined_here = False  # this rank is in hvd.join()
        self._gpu: torch.device | None = None  # where a joined rank's stand-ins go
        self._rejoined = threading.Event()  # join is over for the named ops too
        self._fresh = False  # rank 0: a name was posted here since the sequencer last looked
        self.decided = 0  # named ops run or served here: hvd.join() counts them (join.py)

    def post(self, op_key: str, rounds: int, run: Run) -> Future[Any]:
        """Post the op named `op_key`, which makes `rounds` collectives (`run` runs it); it
        runs once every rank has posted it.

        Raises:
            ValueError: an op of that name is still waiting or running here.
        """
        h = digest(op_key)
        with self._lock:
            busy = self._waiting.get(h)
            if busy is not None:
                what = op_key.split(".", 1)[0]
                same = "the same name as" if busy.key == op_key else f"a hash equal to {busy.key!r}"
                raise ValueError(
                    f"cannot {what} a tensor named {op_key!r}: requested with {same} another "
                    "tensor that is currently being processed (Horovod refuses this too); "
                    "give each operation in flight its own name, or synchronize the first one "
                    "before"
                )
            posted = _Posted(op_key, run)
            self._waiting[h] = posted
            if self.comm.rank == 0:  # wake the sequencer if it waits for the others
                self._rounds[h] = rounds
                self._fresh = True
                self.comm.engine.wake()
            else:
                self._send([h, rounds, 0], 0, _ANNOUNCE)
            start = not self._serving
            self._serving = True
        if start:
            self._worker.submit(self._serve)
        return posted.future

    def join(self, gpu: torch.device | None) -> None:
        """This rank enters hvd.join(): serve the named ops decided meanwhile."""
        with self._lock:
            self._joined_here, self._gpu = True, gpu
            self._rejoined.clear()
            if self.comm.rank == 0:
                self._joined.add(0)
                self._fresh = True
                self.comm.engine.wake()
            else:
                self._send([_JOINED, 0, 0], 0, _ANNOUNCE)
            start = not self._serving
            self._serving = True
        if start:
            self._worker.submit(self._serve)

    def unjoin(self) -> None:
        """hvd.join() returned on every rank: wait until rank 0 has heard it from all."""
        if self.comm.rank != 0:
            with self._lock:
                self._send([_UNJOINED, 0, 0], 0, _ANNOUNCE)
        self._rejoined.wait()

    def close(self) -> None:
        self._worker.stop()

    # ----------------------------------------------------------------- the worker
    def _send(self, values: list[int], dst: int, tag: int) -> None:
        self._sends = [s for s in self._sends if not s[0].done()]
        msg = torch.tensor(values, dtype=torch.int64)
        self._sends.append((self.comm.isend(msg, dst, tag), msg))

    def _serve(self) -> None:
        """Run named ops as they are decided, while some wait here or this rank has joined."""
        try:
            while True:
                with self._lock:
                    if not self._waiting and not self._joined_here:
                        self._serving = False
                        return
                h, rounds, in_join = self._decide() if self.comm.rank == 0 else self._receive()
                if h == _END:
                    with self._lock:
                        self._joined_here = False
                    self._rejoined.set()
                    continue
                with self._lock:
                    posted = self._waiting.get(h)
                if posted is not None:
                    self._run(h, posted, in_join)
                elif self._joined_here:  # an op of the others, served with stand-ins
                    self._stand_in(rounds)
                else:  # rank 0 decides only names every rank posted (or joined)
                    raise PlaitError(f"rank 0 decided a named op this rank never posted ({h})")
        except BaseException as e:  # the communicator failed: so does every waiting op
            with self._lock:
                failed, self._waiting = list(self._waiting.values()), {}
                self._serving = False
            self._rejoined.set()
            for posted in failed:
                posted.future.finish(None, e)

    def _run(self, h: int, posted: _Posted, in_join: bool) -> None:
        try:
            result, error = posted.run(self.comm, in_join), None
        except Exception as e:  # a mismatch under this name: this op fails, the rest go on
            result, error = None, e
        with self._lock:
            del self._waiting[h]  # the name is free again before anyone sees the result
        self.decided += 1
        posted.future.finish(result, error)

    def _stand_in(self, rounds: int) -> None:
        """A joined rank's part in a named op of `rounds` collectives (join.py)."""
        self.decided += 1
        for _ in range(rounds):
            plan = joining.agree(self.comm, joining.joined_row(0))
            if plan.refused:  # the others raise and make no more calls of this op
                return
            joining.serve(self.comm, plan, self._gpu)

    def _receive(self) -> tuple[int, int, bool]:
        """Another rank: rank 0's next decision."""
        buf = torch.empty(3, dtype=torch.int64)
        self.comm.recv(buf, 0, _DECIDE)
        h, rounds, in_join = buf.tolist()
        return h, rounds, bool(in_join)

    def _decide(self) -> tuple[int, int, bool]:
        """Rank 0: wait for the first op that every rank that has not joined posted (this
        rank's first, unless it has joined), or for the end of a join; tell every rank."""
        while True:
            with self._lock:
                self._fresh = False  # set again by a post here: _take then returns
            while (h := self._ready()) is None:
                self._take(block=True)
                with self._lock:
                    self._fresh = False
            while self._take(block=False):  # batch what has come meanwhile
                pass
            if (h := self._ready()) is not None:
                break
        if h == _END:
            with self._lock:
                self._joined.clear()
                self._left = 0
            return _END, 0, False
        with self._lock:
            self._announced.pop(h, None)
            decision = [h, self._rounds.pop(h), int(bool(self._joined))]
            for r in range(1, self.comm.size):
                self._send(decision, r, _DECIDE)
        return h, decision[1], bool(decision[2])

    def _ready(self) -> int | None:
        with self._lock:  # hvd.join() on the script's thread adds this rank to _joined
            if self._left == self.comm.size - 1:  # join() returned on every rank
                return _END
            needed = set(range(1, self.comm.size)) - self._joined
            for h in self._waiting:
                if self._announced.get(h, set()) >= needed:
                    return h
            if 0 in self._joined:  # names this rank will not post
                for h, who in self._announced.items():
                    if who >= needed:
                        return h
        return None

    def _take(self, block: bool) -> bool:
        """Rank 0: note one other rank's message (False: none had come, not blocking; or,
        blocking, this rank posted a name meanwhile)."""
        buf = torch.empty(3, dtype=torch.int64)
        src = self.comm.irecv_any(buf, _ANNOUNCE)
        if not block and not src.done() and src.source < 0:  # nothing has come
            return False
        if block and not src.arrive(lambda: self._fresh):
            return False
        src.wait()
        h, rounds, _ = buf.tolist()
        with self._lock:
            if h == _JOINED:
                self._joined.add(src.source)
            elif h == _UNJOINED:
                self._joined.discard(src.source)
                self._left += 1
                self._send([_END, 0, 0], src.source, _DECIDE)
            else:
                self._announced.setdefault(h, set()).add(src.source)
                self._rounds[h] = rounds
        return True

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
compares what each rank passed under one name. Per named op: one 8-byte message to rank 0
from each other rank, one back, then the collective. An op whose name some rank never posts
waits (PLAIT_TIMEOUT), as Horovod's stalls; one that can finish is never held up by one
that cannot.
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

_ANNOUNCE, _DECIDE = 1, 2  # message tags on the named communicator


def key(prefix: str, name: str | None) -> str | None:
    """Horovod's name of an op: `allreduce.<name>` (None: an unnamed op, matched by order)."""
    return None if name is None else f"{prefix}.{name}"


def digest(op_key: str) -> int:
    """The 63-bit number that stands for `op_key` on the wire."""
    return int.from_bytes(hashlib.blake2b(op_key.encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class _Posted:
    key: str
    run: Callable[[Communicator], Any]
    future: Future[Any] = field(default_factory=Future)


class NameTable:
    """The named ops of one process set: posted, negotiated with rank 0, run in its order."""

    def __init__(self, comm: Communicator, label: str) -> None:
        self.comm = comm  # the named ops' own communicator (the same ranks as the ordered one)
        self._worker = CallThread(f"plait-hvd-names-{label}")
        self._lock = threading.Lock()
        self._waiting: dict[int, _Posted] = {}  # posted here, not run yet; in posting order
        self._serving = False  # a serve loop is queued or running on the worker
        self._announced: dict[int, set[int]] = {}  # rank 0: which others posted each name
        self._sends: list[Any] = []  # announcements on their way (their buffers live here)

    def post(self, op_key: str, run: Callable[[Communicator], Any]) -> Future[Any]:
        """Post the op named `op_key` (`run(comm)` runs it); it runs once every rank has.

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
            start = not self._serving
            self._serving = True
            if self.comm.rank != 0:
                self._sends = [s for s in self._sends if not s[0].done()]
                msg = torch.tensor([h], dtype=torch.int64)
                self._sends.append((self.comm.isend(msg, 0, _ANNOUNCE), msg))
        if start:
            self._worker.submit(self._serve)
        return posted.future

    def close(self) -> None:
        self._worker.stop()

    # ----------------------------------------------------------------- the worker
    def _serve(self) -> None:
        """Run named ops as they are decided, until none waits here."""
        try:
            while True:
                with self._lock:
                    if not self._waiting:
                        self._serving = False
                        return
                h = self._decide() if self.comm.rank == 0 else self._next_decision()
                with self._lock:
                    posted = self._waiting.get(h)
                if posted is None:  # rank 0 decides only names every rank posted
                    raise PlaitError(f"rank 0 decided a named op this rank never posted ({h})")
                self._run(h, posted)
        except BaseException as e:  # the communicator failed: so does every waiting op
            with self._lock:
                failed, self._waiting = list(self._waiting.values()), {}
                self._serving = False
            for posted in failed:
                posted.future.finish(None, e)

    def _run(self, h: int, posted: _Posted) -> None:
        try:
            result, error = posted.run(self.comm), None
        except Exception as e:  # a mismatch under this name: this op fails, the rest go on
            result, error = None, e
        with self._lock:
            del self._waiting[h]  # the name is free again before anyone sees the result
        posted.future.finish(result, error)

    def _next_decision(self) -> int:
        """Another rank: the hash of the next op rank 0 decided."""
        buf = torch.empty(1, dtype=torch.int64)
        self.comm.recv(buf, 0, _DECIDE)
        return int(buf[0])

    def _decide(self) -> int:
        """Rank 0: wait for the first waiting op that every rank has posted, in the order
        this rank posted them; tell every rank; return its hash."""
        others = self.comm.size - 1
        while True:
            while (h := self._ready(others)) is None:
                self._take_announcement(block=True)
            while self._take_announcement(block=False):  # batch what has come meanwhile
                pass
            h = self._ready(others)
            assert h is not None
            del self._announced[h]
            msg = torch.tensor([h], dtype=torch.int64)
            sends = [self.comm.isend(msg, r, _DECIDE) for r in range(1, self.comm.size)]
            for s in sends:
                s.wait()
            return h

    def _ready(self, others: int) -> int | None:
        with self._lock:
            for h in self._waiting:
                if len(self._announced.get(h, ())) == others:
                    return h
        return None

    def _take_announcement(self, block: bool) -> bool:
        """Rank 0: note one other rank's announcement (False: none had come, not blocking)."""
        buf = torch.empty(1, dtype=torch.int64)
        src = self.comm.irecv_any(buf, _ANNOUNCE)
        if not block and not src.done() and src.source < 0:  # nothing has come
            return False
        src.wait()
        self._announced.setdefault(int(buf[0]), set()).add(src.source)
        return True

"""A server's shard on disk: written atomically, read back when a server restarts.

    <dir>/ps-server-<i>.pt        the shard: values, optimizer state, versions, clocks, ...
                                  (torch.save to a temp file, fsync, os.replace, fsync dir)
    <dir>/ps-server-<i>.progress  the number of updates applied so far, rewritten after
                                  every update (8 bytes, no fsync: it survives the process
                                  being killed, not the machine losing power). On resume,
                                  progress - the shard's count = the updates lost.

Only files this job wrote are read, with torch.load(weights_only=True): tensors and plain
containers, never arbitrary pickled objects.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Shard:
    """What a server writes: the state a restarted server needs to serve on."""

    values: dict[int, torch.Tensor]  # key -> its flat value
    opt: dict[int, dict[str, torch.Tensor]]  # key -> its optimizer's state
    versions: dict[int, int]  # key -> updates applied to it
    clocks: list[int]  # per worker: the gradients it pushed
    max_push_rid: list[int]  # per worker: its last applied push's request id
    status: list[str]  # per worker: live | done | dead (| absent: an id not joined)
    updates: int  # updates applied, over all restarts
    lost_updates: int  # updates lost to restarts so far
    first: list[int] = field(default_factory=list)  # per worker: its first sync round


def shard_path(directory: str, server: int) -> str:
    return os.path.join(directory, f"ps-server-{server}.pt")


def save(directory: str, server: int, shard: Shard) -> str:
    """Write `shard` atomically: a reader sees the previous shard or this one, never half."""
    # a plain dict of tensors and containers on disk, so that weights_only=True can read it
    state = {f.name: getattr(shard, f.name) for f in fields(Shard)}
    os.makedirs(directory, exist_ok=True)
    path = shard_path(directory, server)
    write_atomic(path, state)
    return path


def write_atomic(path: str, state: Any) -> None:
    """torch.save `state` to `path` atomically: a temporary file beside it, fsync'ed, then
    renamed over it (and the directory fsync'ed, so the rename survives a power cut)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(directory: str, server: int) -> Shard | None:
    """The last shard written, or None when there is none."""
    path = shard_path(directory, server)
    if not os.path.exists(path):
        return None
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return Shard(
        values=dict(state["values"]),
        opt=dict(state["opt"]),
        versions=dict(state["versions"]),
        clocks=list(state["clocks"]),
        max_push_rid=list(state["max_push_rid"]),
        status=list(state["status"]),
        updates=int(state["updates"]),
        lost_updates=int(state["lost_updates"]),
        first=list(state.get("first", [])),  # a shard from before elastic workers has none
    )


class Progress:
    """The update counter beside the shard (see the module docstring)."""

    _FMT = struct.Struct("<q")

    def __init__(self, directory: str, server: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"ps-server-{server}.progress")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def read(self) -> int:
        data = os.pread(self.fd, self._FMT.size, 0)
        return self._FMT.unpack(data)[0] if len(data) == self._FMT.size else 0

    def write(self, updates: int) -> None:
        os.pwrite(self.fd, self._FMT.pack(updates), 0)

    def close(self) -> None:
        os.close(self.fd)

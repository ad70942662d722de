"""What travels on an engine connection: the frame layout, its kinds, and tensors as bytes.

Per message: a 17-byte header (kind u8, tag u64, nbytes u64), then, for DATA, `nbytes` raw
bytes. Kinds:
- DATA: a tensor's bytes.
- HEARTBEAT: nothing; keeps a silent but live peer from being declared frozen.
- BYE: a clean goodbye; the sender reads on until we hang up too.
- FAIL: the text "rank:reason", telling the peers which rank failed.
- PIPE_OPEN: the text "name:capacity" of a shared-memory pipe the sender made for this peer
  (shm_pipe.py).
- PIPE_DATA: a header only; its `nbytes` of payload are the next bytes through that pipe.
- NUDGE: nothing; wakes a peer asleep on a pipe.
Nothing received is ever unpickled.
"""

from __future__ import annotations

import ctypes
import struct

import torch

HEADER = struct.Struct("<BQQ")  # kind, tag, nbytes
DATA, HEARTBEAT, BYE, FAIL, PIPE_OPEN, PIPE_DATA, NUDGE = 1, 2, 3, 4, 5, 6, 7
WITH_BODY = (FAIL, PIPE_OPEN)  # control frames whose `nbytes` of text follow the header

STAGE_BYTES = 1 << 16  # reads go through a staging buffer of this size unless large

# the control frames without a body, packed once (each send wraps them in a fresh view)
HEARTBEAT_FRAME = HEADER.pack(HEARTBEAT, 0, 0)
BYE_FRAME = HEADER.pack(BYE, 0, 0)
NUDGE_FRAME = HEADER.pack(NUDGE, 0, 0)


def with_text(kind: int, text: bytes) -> list[memoryview]:
    """A control frame carrying `text` (FAIL, PIPE_OPEN), as the pieces to write."""
    return [memoryview(HEADER.pack(kind, 0, len(text))), memoryview(text)]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a 1-D contiguous CPU tensor (any dtype, bfloat16 included).

    Not through `Tensor.numpy()`: that marks the tensor's storage not resizable for good
    (numpy keeps a raw pointer), and ZeRO-3 frees a unit's parameters by resizing their
    storage to 0 once its gathers (over TCP: here) are done. The ctypes array holds the
    tensor, so the view keeps the memory alive; no resize may happen while a transfer
    uses it (the collectives' contract: a tensor is not touched until `wait()`).
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    array.tensor = t  # type: ignore[attr-defined]  # (the memory's owner, kept alive)
    return memoryview(array).cast("B")

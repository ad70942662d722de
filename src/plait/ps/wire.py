"""The message format: one msgpack header frame, then one raw frame per tensor.

On the socket a message goes behind one more frame, its tag (auth.py): the MAC of the
header under the session's key, empty for the handshake. `encode`/`decode` see no tag.

    frame 0   msgpack map (string keys, schema below), at most MAX_HEADER_BYTES
    frame i   the bytes of tensor i-1 (C-contiguous, little-endian as the host), sent with
              send_multipart(copy=False) and read back with torch.frombuffer: no copy either way

Header fields (anything else is rejected):

    v         int, must be VERSION
    op        str, one of OPS
    rid       int >= 0, the request id (a reply carries the id of its request)
    w         int >= -1, the worker index (-1: sent by a server)
    keys      list of int >= 0: the slice keys, one per tensor frame (pull: the keys wanted)
    dtypes    list of str from DTYPES, one per tensor frame
    shapes    list of list of int >= 0, one per tensor frame; numel * itemsize = frame bytes
    versions  list of int >= 0: one per key, or empty
    lr        float > 0 or nil
    clock     int >= 0
    meta      map of str -> nil/bool/int/float/str/list of int (small extras: errors, stats,
              `part` i of `parts` n of a reply cut per key: PSConfig(priority=True))

Nothing here is unpickled; a message that breaks any rule raises WireError(reason).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from plait.comm.core.dtypes import FLOATS, NAMES
from plait.errors import PlaitError

VERSION = 2  # 2: a tag frame leads every message on the socket (auth.py)
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 1 << 14
MAX_FRAME_BYTES = 1 << 31
MAX_META_ITEMS = 64
MAX_STR = 4096
MAX_INT = 1 << 62
REQUESTS = ("init", "push", "pull", "push_pull", "hb", "stats", "bye", "join", "save")
REPLIES = ("ok", "error")
HANDSHAKE = ("hello", "challenge", "auth", "auth_first")  # auth.py's, never a Server's
OPS = REQUESTS + REPLIES + HANDSHAKE
# the floating-point rows of plait's dtype table: servers apply optimizers to what they hold
DTYPE_NAMES = {d: NAMES[d] for d in FLOATS}
DTYPES: dict[str, torch.dtype] = {n: d for d, n in DTYPE_NAMES.items()}
_FIELDS = ("v", "op", "rid", "w", "keys", "dtypes", "shapes", "versions", "lr", "clock", "meta")


class WireError(PlaitError, ValueError):
    """A message that does not follow the wire format; `reason` says which rule it broke."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed message: {reason}")


@dataclass
class Message:
    """A decoded (or to-be-encoded) message: the header fields and one tensor per frame."""

    op: str
    rid: int = 0
    worker: int = -1
    keys: list[int] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    lr: float | None = None
    clock: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _buffer(t: torch.Tensor) -> memoryview:
    # a byte view of the tensor's memory (bfloat16 has no numpy dtype: go through uint8)
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError("wire tensors must be contiguous CPU tensors")
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of `msg`: its header, then each tensor's memory (not copied)."""
    for t in msg.tensors:
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {t.dtype} cannot be sent; expected one of {list(DTYPES)}")
    header = {
        "v": VERSION,
        "op": msg.op,
        "rid": msg.rid,
        "w": msg.worker,
        "keys": list(msg.keys),
        "dtypes": [DTYPE_NAMES[t.dtype] for t in msg.tensors],
        "shapes": [list(t.shape) for t in msg.tensors],
        "versions": list(msg.versions),
        "lr": msg.lr,
        "clock": msg.clock,
        "meta": msg.meta,
    }
    return [msgpack.packb(header, use_bin_type=True), *(_buffer(t) for t in msg.tensors)]


def _int(h: dict[str, Any], name: str, lo: int, hi: int = MAX_INT) -> int:
    value = h.get(name, 0)
    if type(value) is not int or not lo <= value <= hi:
        raise WireError(f"field {name!r} must be an int in [{lo}, {hi}]; got {value!r:.80}")
    return value


def _int_list(h: dict[str, Any], name: str, limit: int) -> list[int]:
    value = h.get(name, [])
    if type(value) is not list or len(value) > limit:
        raise WireError(f"field {name!r} must be a list of at most {limit} ints")
    for item in value:
        if type(item) is not int or not 0 <= item <= MAX_INT:
            raise WireError(f"field {name!r} holds {item!r:.80}; expected ints >= 0")
    return value


def _meta(h: dict[str, Any]) -> dict[str, Any]:
    meta = h.get("meta", {})
    if type(meta) is not dict or len(meta) > MAX_META_ITEMS:
        raise WireError(f"field 'meta' must be a map of at most {MAX_META_ITEMS} items")
    for k, v in meta.items():
        if type(k) is not str or len(k) > 64:
            raise WireError(f"meta key {k!r:.80} is not a short string")
        if isinstance(v, str):
            if len(v) > MAX_STR:
                raise WireError(f"meta[{k!r}] is a string longer than {MAX_STR}")
        elif isinstance(v, list):
            if len(v) > MAX_FRAMES or any(type(x) is not int for x in v):
                raise WireError(f"meta[{k!r}] must be a list of at most {MAX_FRAMES} ints")
        elif v is not None and type(v) not in (bool, int, float):
            raise WireError(f"meta[{k!r}] has type {type(v).__name__}; expected a scalar")
    return meta


def decode(frames: Sequence[Any]) -> Message:
    """Parse and check a received message (a list of zmq.Frame or bytes-like objects).

    Raises:
        WireError: the message breaks a rule of the format (never any other exception).
    """
    try:
        return _decode(frames)
    except WireError:
        raise
    except Exception as e:  # a rule this decoder forgot to check is still a WireError
        raise WireError(f"undecodable message ({type(e).__name__}: {e})") from None


def _bytes_of(frame: Any) -> memoryview:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _decode(frames: Sequence[Any]) -> Message:
    if not 1 <= len(frames) <= MAX_FRAMES + 1:
        raise WireError(f"expected 1 to {MAX_FRAMES + 1} frames; got {len(frames)}")
    head = _bytes_of(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(head)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=0,
            max_array_len=MAX_FRAMES,
            max_map_len=MAX_META_ITEMS,
            max_ext_len=0,
        )
    except Exception as e:
        raise WireError(f"header is not valid msgpack ({type(e).__name__})") from None
    if type(h) is not dict:
        raise WireError(f"header must be a map; got {type(h).__name__}")
    unknown = [k for k in h if k not in _FIELDS]
    if unknown:
        raise WireError(f"unknown header fields {unknown!r:.200}")
    if h.get("v") != VERSION:
        raise WireError(f"protocol version {h.get('v')!r:.40}; expected {VERSION}")
    op = h.get("op")
    if op not in OPS:
        raise WireError(f"op {op!r:.40} is not one of {OPS}")
    rid = _int(h, "rid", 0)
    worker = _int(h, "w", -1)
    clock = _int(h, "clock", 0)
    keys = _int_list(h, "keys", MAX_FRAMES)
    versions = _int_list(h, "versions", MAX_FRAMES)
    lr = h.get("lr")
    if lr is not None and (type(lr) is not float or not math.isfinite(lr) or lr <= 0):
        raise WireError(f"field 'lr' must be a finite float > 0 or nil; got {lr!r:.40}")
    dtypes, shapes = h.get("dtypes", []), h.get("shapes", [])
    if type(dtypes) is not list or type(shapes) is not list:
        raise WireError("fields 'dtypes' and 'shapes' must be lists")
    ntensors = len(frames) - 1
    if len(dtypes) != ntensors or len(shapes) != ntensors:
        raise WireError(
            f"{ntensors} tensor frames but {len(dtypes)} dtypes and {len(shapes)} shapes"
        )
    if ntensors and len(keys) != ntensors:
        raise WireError(f"{ntensors} tensor frames but {len(keys)} keys")
    if versions and len(versions) != len(keys):
        raise WireError(f"{len(versions)} versions for {len(keys)} keys")
    tensors = [_tensor(frames[i + 1], dtypes[i], shapes[i], i) for i in range(ntensors)]
    meta = _meta(h)
    return Message(op, rid, worker, keys, tensors, versions, lr, clock, meta)


def _tensor(frame: Any, dtype_name: Any, shape: Any, i: int) -> torch.Tensor:
    if type(dtype_name) is not str or dtype_name not in DTYPES:
        raise WireError(f"frame {i}: dtype {dtype_name!r:.40} is not one of {list(DTYPES)}")
    dtype = DTYPES[dtype_name]
    if type(shape) is not list or len(shape) > 8:
        raise WireError(f"frame {i}: shape must be a list of at most 8 dims")
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_FRAME_BYTES:
            raise WireError(f"frame {i}: shape {shape!r:.80} has a bad dimension")
        numel *= d
    data = _bytes_of(frame)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize > MAX_FRAME_BYTES:
        raise WireError(f"frame {i}: {numel * itemsize} bytes is over {MAX_FRAME_BYTES}")
    if len(data) != numel * itemsize:
        raise WireError(
            f"frame {i}: shape {shape} of {dtype_name} needs {numel * itemsize} bytes; "
            f"the frame has {len(data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # zmq frames are read-only; we never write into them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).view(shape)

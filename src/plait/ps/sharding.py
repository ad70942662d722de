"""The sharding plan: which server holds which slice of which parameter (pure, no I/O).

Words used everywhere in plait.ps:
  parameter  one named tensor of the model, seen flat (1-D, numel elements)
  segment    a contiguous range [start, stop) of one parameter's flat elements
  key        the unit a server stores, versions and updates: one slice of a large parameter
             (a single segment) or a pack of whole small parameters (several segments),
             always of one dtype and at most `slice_bytes` bytes
Keys are numbered in parameter order; key k is the k-th flat 1-D tensor of the plan.

A parameter of more than slice_bytes is cut into ceil(bytes / slice_bytes) near-equal
slices, so one large tensor is spread over every server; smaller parameters are packed, in
order and per dtype, into packs of at most slice_bytes (one message per pack instead of one
per bias). Keys are then placed greedily, largest first, each on the server holding the
fewest bytes so far (LPT). Each key is at most slice_bytes, so the fullest and the emptiest
server differ by at most one slice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about a parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Segment:
    param: int  # index into the plan's parameter list
    start: int  # flat element range [start, stop) of that parameter
    stop: int


@dataclass(frozen=True)
class Key:
    key: int
    server: int
    dtype: torch.dtype
    segments: tuple[Segment, ...]  # laid end to end in the key's flat tensor

    @property
    def numel(self) -> int:
        return sum(s.stop - s.start for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Plan:
    params: tuple[ParamSpec, ...]
    keys: tuple[Key, ...]
    num_servers: int
    slice_bytes: int

    def keys_of(self, server: int) -> list[Key]:
        return [k for k in self.keys if k.server == server]

    @property
    def bytes_per_server(self) -> list[int]:
        total = [0] * self.num_servers
        for k in self.keys:
            total[k.server] += k.nbytes
        return total

    def describe(self) -> str:
        per = ", ".join(
            f"server {i}: {b / 2**20:.2f} MiB" for i, b in enumerate(self.bytes_per_server)
        )
        return f"{len(self.keys)} keys over {self.num_servers} servers ({per})"


def make_plan(params: list[ParamSpec], num_servers: int, slice_bytes: int) -> Plan:
    """Cut `params` into keys of at most `slice_bytes` and spread them over the servers."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1; got {num_servers}")
    pieces: list[tuple[torch.dtype, tuple[Segment, ...]]] = []
    packs: dict[torch.dtype, list[Segment]] = {}  # the open pack of each dtype
    for i, p in enumerate(params):
        if p.numel == 0:
            continue
        per_slice = max(1, slice_bytes // p.itemsize)
        if p.numel > per_slice:
            n = -(-p.numel // per_slice)
            bounds = [p.numel * j // n for j in range(n + 1)]
            pieces.extend((p.dtype, (Segment(i, bounds[j], bounds[j + 1]),)) for j in range(n))
            continue
        pack = packs.setdefault(p.dtype, [])
        if sum(s.stop - s.start for s in pack) + p.numel > per_slice:
            pieces.append((p.dtype, tuple(pack)))
            pack.clear()
        pack.append(Segment(i, 0, p.numel))
    pieces.extend((dtype, tuple(pack)) for dtype, pack in packs.items() if pack)
    pieces.sort(key=lambda piece: (piece[1][0].param, piece[1][0].start))  # parameter order
    sizes = [
        sum(s.stop - s.start for s in segs) * torch.empty((), dtype=dt).element_size()
        for dt, segs in pieces
    ]
    load = [0] * num_servers
    server_of = [0] * len(pieces)
    for k in sorted(range(len(pieces)), key=lambda k: (-sizes[k], k)):
        target = min(range(num_servers), key=lambda s: (load[s], s))
        server_of[k] = target
        load[target] += sizes[k]
    keys = tuple(Key(k, server_of[k], dtype, segs) for k, (dtype, segs) in enumerate(pieces))
    return Plan(tuple(params), keys, num_servers, slice_bytes)


def gather(plan: Plan, key: Key, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The flat tensor of `key` from full per-parameter tensors (a view for a single slice)."""
    parts = [tensors[s.param].detach().reshape(-1)[s.start : s.stop] for s in key.segments]
    if len(parts) == 1:
        return parts[0].contiguous()
    return torch.cat(parts)


def scatter(key: Key, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `key`'s flat tensor into the full per-parameter tensors (in place)."""
    offset = 0
    for s in key.segments:
        n = s.stop - s.start
        tensors[s.param].detach().view(-1)[s.start : s.stop].copy_(flat[offset : offset + n])
        offset += n


def specs_to_json(specs: list[ParamSpec]) -> str:
    from plait.ps.wire import DTYPE_NAMES

    return json.dumps([[s.name, list(s.shape), DTYPE_NAMES[s.dtype]] for s in specs])


def specs_from_json(text: str | bytes) -> list[ParamSpec]:
    from plait.ps.wire import DTYPES

    return [ParamSpec(name, tuple(shape), DTYPES[dt]) for name, shape, dt in json.loads(text)]


def key_mismatch(
    mine: dict[int, Key],
    keys: list[int],
    tensors: list[torch.Tensor],
    versions: list[int],
    *,
    whole: bool,
) -> str | None:
    """What is wrong with a request's keys, tensors and versions for a server holding
    `mine`; None when nothing is. `whole`: it must carry every key of the server, each with
    its tensor (init, push); else it names some of them (a pull: keys, no tensor)."""
    held = sorted(mine)
    unknown = [k for k in keys if k not in mine]
    if unknown:
        return f"unknown keys {unknown[:20]}; this server holds {held[:20]}"
    if whole and list(keys) != held:
        return f"expected keys {held[:20]} (this server's); got {keys[:20]}"
    if whole and len(tensors) != len(keys):
        return f"{len(tensors)} tensors for {len(keys)} keys"
    for k, t in zip(keys, tensors, strict=False):
        spec = mine[k]
        if t.dtype != spec.dtype or list(t.shape) != [spec.numel]:
            return (
                f"key {k}: expected a {spec.dtype} tensor of shape [{spec.numel}]; "
                f"got {t.dtype} of shape {list(t.shape)}"
            )
    if versions and len(versions) != len(keys):
        return f"{len(versions)} versions for {len(keys)} keys"
    return None

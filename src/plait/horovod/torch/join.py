"""hvd.join(): ranks that ran out of data keep serving the collectives of the others.

plait's Communicator matches calls strictly in order, and (with its call check on, the
default) every collective first exchanges a short record of each rank's call. A joined rank
loops on one distinctive call, an allgather of an 8-int row describing its state. While the
others still run ordinary collectives, that call meets theirs and the call check raises
CollectiveMismatchError on every rank at the same call: the ranks that have not joined see
the join call in the error and switch to *join mode*. In join mode, before each collective,
every rank allgathers a row (ranks that have not joined describe the call they are about to
make; joined ranks say "joined"), then all make the call, joined ranks with stand-ins:

    allreduce   zeros for sum/avg (Horovod: avg still divides by the full size),
                the identity for min/max/prod
    barrier     a barrier
    anything else (allgather, broadcast, alltoall, reducescatter, object collectives...):
                refused, as Horovod refuses them ("... is not supported with Join"): the
                ranks that made the call raise HorovodInternalError, the joined ranks stay
                joined and serve the next call. Never a hang.

Stand-ins are made on the kind of device the others' tensors are on (the row says which):
the communicator routes a call by its tensor's device, so a CPU stand-in would not meet
CUDA tensors on the other ranks. On CUDA they go on hvd.join(device)'s GPU, or the current
one. The rows themselves are CPU tensors: metadata that only travels between ranks.

When every row says "joined", join() returns on every rank the rank that joined last (the
latest in the sequence of collectives; ties go to the highest rank), and join mode ends.
Ordinary collectives pay nothing for this: join mode starts only after a rank joined.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from plait.comm.core.dtypes import CODES, DTYPES, NAMES
from plait.comm.dispatch.agreement import Call, check_enabled
from plait.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from plait.comm.communicator import Communicator


class Described(Protocol):
    """What a row says of the call a rank is about to make (dispatch.py's `Op`)."""

    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype | None: ...
    @property
    def numel(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def root(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def device(self) -> str: ...


_ROW = 8  # kind, dtype, op, root, numel, shape crc, rounds at join, device
_KINDS = (
    "joined",
    "allreduce",
    "allgather",
    "broadcast",
    "barrier",
    # ops that joined ranks cannot take part in
    "alltoall",
    "reducescatter",
    "broadcast_object",
    "allgather_object",
    "add_process_set",
    "other",
    "adasum",
)
_SERVED = ("allreduce", "barrier")  # what Horovod serves while a rank has joined
_OPS = ("-", "sum", "avg", "min", "max", "prod")
_DEVICES = ("cpu", "cuda")  # the device types the communicator carries; cpu's code is 0
_SAME = (0, 1, 2, 3, 4, 5, 7)  # the fields every rank that has not joined must agree on

# What the call check shows for a joined rank's call (plait formats it; we only compare)
_SIGNAL = str(Call.of("allgather", torch.empty((1, _ROW), dtype=torch.int64), algorithm="ring"))


def is_join_signal(err: CollectiveMismatchError) -> bool:
    """Whether a call-check failure was caused by a rank that has joined."""
    return _SIGNAL in err.calls


def require_check() -> None:
    if not check_enabled():
        raise RuntimeError(
            "hvd.join() needs plait's call check, which PLAIT_CHECK=0 turns off: joined ranks "
            "learn what the others call from it. Unset PLAIT_CHECK (on every rank) to use join."
        )


@dataclass(frozen=True)
class Plan:
    """What every rank agreed to do this round."""

    all_joined: bool
    last: int  # the rank that joined last (when all_joined)
    kind: str = "-"
    dtype: torch.dtype = torch.float32
    op: str = "-"
    root: int = -1
    numel: int = 0
    device: str = "cpu"
    refused: str = ""  # why the call is refused (the ranks that made it raise this)


def _refusal(kind: str, joined: list[int]) -> str:
    """Horovod's refusal of a call joined ranks cannot serve, with what to do instead."""
    what = {
        "allgather": "Allgather",
        "broadcast": "Broadcast",
        "alltoall": "Alltoall",
        "adasum": "Adasum allreduce",
        "other": "This call",
    }
    text = f"{what.get(kind, kind.capitalize())} is not supported with Join at this time"
    hint = {
        "allgather": "; DistributedOptimizer: sparse_as_dense=True reduces sparse gradients "
        "with allreduce, which join serves",
    }
    return (
        f"{text} (ranks {joined} have called hvd.join(); while a rank has joined, only "
        f"allreduce and barrier are served){hint.get(kind, '')}"
    )


def _crc(shape: tuple[int, ...]) -> int:
    return zlib.crc32(repr(tuple(shape)).encode()) & 0x7FFFFFFF


def describe(op: Described, rounds: int) -> torch.Tensor:
    """The row a rank that has not joined contributes before making `op`."""
    kind = op.kind if op.kind in _KINDS else "other"
    dtype = CODES[op.dtype] + 1 if op.dtype in CODES else 0
    fields = [_KINDS.index(kind), dtype, _OPS.index(op.op), op.root, op.numel, _crc(op.shape)]
    device = _DEVICES.index(op.device) if op.device in _DEVICES else 0
    return torch.tensor([[*fields, rounds, device]], dtype=torch.int64)


def joined_row(rounds: int) -> torch.Tensor:
    return torch.tensor([[0, 0, 0, -1, 0, 0, rounds, 0]], dtype=torch.int64)


def _text(row: list[int]) -> str:
    kind = _KINDS[row[0]]
    if kind == "joined":
        return "joined (hvd.join)"
    if kind not in ("allreduce", "allgather", "broadcast"):
        return kind
    dtype = NAMES[DTYPES[row[1] - 1]] if row[1] else "-"
    extra = {"allreduce": f", op={_OPS[row[2]]}", "broadcast": f", root_rank={row[3]}"}
    size = "elements per row" if kind == "allgather" else "elements"
    where = f", device={_DEVICES[row[7]]}" if row[7] else ""
    return f"{kind}(dtype={dtype}, {size}={row[4]}{extra.get(kind, '')}{where})"


def agree(comm: Communicator, mine: torch.Tensor) -> Plan:
    """One join-mode round: share rows, check them alike on every rank, return the plan."""
    rows = comm.allgather(mine, algorithm="ring").tolist()
    joined = [r for r, row in enumerate(rows) if row[0] == 0]
    active = [r for r, row in enumerate(rows) if row[0] != 0]
    if not active:
        last = max(range(len(rows)), key=lambda r: (rows[r][6], r))
        return Plan(all_joined=True, last=last)
    calls = [_text(row) for row in rows]
    if len({tuple(rows[r][i] for i in _SAME) for r in active}) > 1:
        raise CollectiveMismatchError(
            calls, f"different calls from the ranks that have not joined (joined: {joined})"
        )
    row = rows[active[0]]
    kind = _KINDS[row[0]]
    if kind not in _SERVED:
        return Plan(False, -1, kind, refused=_refusal(kind, joined))
    dtype = DTYPES[row[1] - 1] if row[1] else torch.float32
    return Plan(False, -1, kind, dtype, _OPS[row[2]], row[3], row[4], _DEVICES[row[7]])


def _identity(plan: Plan, where: torch.device) -> torch.Tensor:
    """What a joined rank contributes to an allreduce."""
    n, dtype = plan.numel, plan.dtype
    if plan.op in ("sum", "avg"):
        return torch.zeros(n, dtype=dtype, device=where)
    if plan.op == "prod":
        return torch.ones(n, dtype=dtype, device=where)
    big = plan.op == "min"  # min's identity is the largest value, max's the smallest
    if dtype == torch.bool:
        return torch.full((n,), big, dtype=torch.bool, device=where)
    if dtype.is_floating_point:
        return torch.full((n,), float("inf") if big else float("-inf"), dtype=dtype, device=where)
    info = torch.iinfo(dtype)
    return torch.full((n,), info.max if big else info.min, dtype=dtype, device=where)


def _stand_in_device(plan: Plan, gpu: torch.device | None) -> torch.device:
    """Where a joined rank's stand-ins go: the kind of device the others' tensors are on."""
    if plan.device == "cpu":
        return torch.device("cpu")
    return gpu if gpu is not None else torch.device("cuda", torch.cuda.current_device())


def serve(comm: Communicator, plan: Plan, gpu: torch.device | None = None) -> None:
    """A joined rank's part in the round's collective (the flat form the others use);
    `gpu` holds its stand-ins when the others' tensors are on CUDA (default: the current)."""
    where = _stand_in_device(plan, gpu)
    if plan.kind == "allreduce":
        comm.allreduce_(_identity(plan, where), plan.op)
    else:
        comm.barrier()

"""Activation and gradient exchange between neighbouring pipeline stages.

Every tensor travels as two messages on the pipeline communicator: a fixed-size int64
header ``[dtype code, ndim, on a GPU, *shape, 0-padding]`` (``HEADER`` elements), then the
payload.
Both use the same tag, and messages between one pair of ranks with one tag arrive in order,
so a receiver needs to know neither shape nor dtype in advance. The header costs one tiny
message per transfer; exchanging shapes once per step would save it, but micro-batches of
an uneven ``torch.chunk`` differ in their first dimension, so per-message headers keep the
code simple and always right.

On GPUs the header stays on the CPU and the payload, a CUDA tensor, goes over NCCL: payloads
between two stages are received in the order they were sent, so they travel as the
communicator's ordered messages (`ordered=True`), which NCCL can carry (it matches by order,
not tag), one lane per direction.

Sends are non-blocking (`isend`): the caller keeps the returned requests (which keep the
tensors alive) and waits on them at the end of the step, so a stage never stalls on a
neighbour that is busy with other work of the schedule.
"""

from __future__ import annotations

import torch

from plait import devices
from plait.comm.communicator import Communicator
from plait.comm.core.dtypes import CODES, DTYPES
from plait.comm.core.request import Request

MAX_NDIM = 8
HEADER = 3 + MAX_NDIM


def header(t: torch.Tensor) -> torch.Tensor:
    """The int64 header describing `t`: [dtype code, ndim, 1 if on a GPU, *shape, padding]."""
    if t.dtype not in CODES:
        raise TypeError(f"pipeline cannot send dtype {t.dtype}; expected one of {DTYPES}")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"pipeline sends tensors of at most {MAX_NDIM} dims; got {t.dim()}")
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0] = CODES[t.dtype]
    h[1] = t.dim()
    h[2] = int(not t.is_cpu)
    if t.dim():
        h[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def send_tensor(comm: Communicator, t: torch.Tensor, peer: int, tag: int) -> list[Request]:
    """Start sending header and payload of `t` to `peer`; wait on the returned requests."""
    payload = t.detach().contiguous()
    # the payloads between two stages arrive in sending order (each stage runs micro-batches
    # in order): on GPUs they go over NCCL (Communicator.isend's `ordered`)
    return [comm.isend(header(payload), peer, tag), comm.isend(payload, peer, tag, ordered=True)]


def recv_tensor(
    comm: Communicator, peer: int, tag: int, device: torch.device | None = None
) -> torch.Tensor:
    """Receive a tensor sent by `send_tensor` from `peer` with `tag` onto `device` (the CPU by
    default); shape and dtype come from its header, which always travels on the CPU."""
    h = comm.recv(torch.empty(HEADER, dtype=torch.int64), peer, tag)
    code, ndim, on_gpu = int(h[0]), int(h[1]), bool(h[2])
    shape = [int(s) for s in h[3 : 3 + ndim]]
    # received on the kind of device it was sent from (a GPU's payload may come over NCCL,
    # a CPU's only through the engine), then moved to `device` if that is another
    here = device or torch.device("cpu")
    if on_gpu != (here.type == "cuda"):
        here = devices.device() if on_gpu else torch.device("cpu")
    out = comm.recv(torch.empty(shape, dtype=DTYPES[code], device=here), peer, tag, ordered=True)
    return out if device is None else out.to(device)

"""The dtypes plait carries between ranks: one table, with a name and a code for each.

Names are torch's own ("float16", "bfloat16", ...): the cross-rank call check and the
parameter server's header write them. Codes are positions in `DTYPES`: the pipeline's
tensor header and the Horovod facade's join rows store them in int64 tensors. Every rank of
a job runs the same plait, so a code means the same dtype on all of them; keep the order
of the table (append new dtypes at the end) so that a code never changes its meaning.
"""

from __future__ import annotations

import torch

from plait import devices

DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
)
CODES: dict[torch.dtype, int] = {d: i for i, d in enumerate(DTYPES)}
NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in DTYPES}
BY_NAME: dict[str, torch.dtype] = {n: d for d, n in NAMES.items()}
FLOATS: tuple[torch.dtype, ...] = tuple(d for d in DTYPES if d.is_floating_point)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`.

    Raises:
        TypeError: a dtype plait does not carry (the message lists those it does).
    """
    try:
        return NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported; expected one of {', '.join(NAMES.values())}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a wire name stands for (KeyError if none); a record's "@cuda" is ignored."""
    return BY_NAME[name.partition("@")[0]]


def record_name(t: torch.Tensor) -> str:
    """`t`'s dtype as a collective's record carries it: the wire name, with "@cuda" for a
    GPU tensor, so that ranks whose tensors sit on different kinds of device (they would take
    different paths and wait for each other forever) disagree in the mismatch check."""
    name = dtype_name(t.dtype)
    return name if t.is_cpu else f"{name}@{t.device.type}"


def on_device(name: str) -> torch.device:
    """The device a tensor described by record `name` lands on here: the CPU, or for a GPU
    record this rank's GPU (the job's, plait.device(); not the calling thread's current
    device, which on the call thread is cuda:0)."""
    kind = name.partition("@")[2].partition(":")[0]  # "float32@cuda:nccl" -> "cuda"
    if kind in ("", "cpu"):
        return torch.device("cpu")
    job = devices.device()
    return job if job.type == kind else torch.device(kind, torch.cuda.current_device())

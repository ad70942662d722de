"""The device of a job's ranks: `cpu`, or `cuda:LOCAL_RANK` on a machine with GPUs.

The device is a property of the job, chosen once by `plait.init()` from PLAIT_DEVICE
(`plait train --device` sets it): `auto` takes the GPU when one is visible. Each local rank
gets its own GPU, as torchrun and Horovod scripts expect (`torch.cuda.set_device(local_rank)`);
a host with more ranks than GPUs is an error unless PLAIT_SHARE_GPU=1, which tests use on
one-GPU machines (rank i then uses GPU i mod count).

Communication follows the tensors, not the job: a CPU tensor on a GPU machine still goes
through plait's engine, shared memory or gloo; a CUDA tensor through NCCL (comm/backends/cuda.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from plait import env
from plait.errors import ConfigError

#: What PLAIT_DEVICE and `--device` accept.
CHOICES = env.REGISTRY["PLAIT_DEVICE"].choices  # auto, cpu, cuda: one table (env.py)

_job_device = torch.device("cpu")
_local_ranks = 1


class DeviceError(ConfigError):
    """The device asked for cannot be had here (no GPU, too few GPUs)."""


def cuda_usable() -> bool:
    """A CUDA GPU is visible to this process."""
    return torch.cuda.is_available()


def nccl_usable() -> bool:
    """NCCL can carry CUDA tensors here: a GPU is visible and torch was built with NCCL."""
    return cuda_usable() and dist.is_nccl_available()


#: Before NCCL 2.30 a communicator with two ranks on one GPU fails ("Duplicate GPU
#: detected"); from 2.30 NCCL_MULTI_RANK_GPU_ENABLE=1 allows it (older NCCLs ignore it).
SHARED_GPU_NCCL = (2, 30)


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL this torch was built with, or None without NCCL."""
    if not dist.is_nccl_available():
        return None
    major, minor, patch = (int(v) for v in torch.cuda.nccl.version()[:3])
    return major, minor, patch


def nccl_problem(local_ranks: int) -> str | None:
    """Why NCCL cannot join `local_ranks` ranks of one host on its GPUs, or None if it can."""
    version = nccl_version()
    if version is None:
        return "this torch has no NCCL"
    gpus = torch.cuda.device_count()
    if local_ranks <= gpus or version >= SHARED_GPU_NCCL:
        return None
    return (
        f"{local_ranks} ranks share {gpus} GPU(s), which NCCL "
        f"{'.'.join(map(str, version))} refuses (NCCL >= 2.30 allows it with "
        "NCCL_MULTI_RANK_GPU_ENABLE=1)"
    )


def _why_no_gpu() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def resolve(requested: str, local_rank: int = 0, local_size: int = 1) -> torch.device:
    """The device of local rank `local_rank` of `local_size` for `requested` (auto, cpu, cuda).

    Raises:
        DeviceError: `requested` is unknown; cuda was asked for where no GPU is visible; or the
            host has more local ranks than GPUs and PLAIT_SHARE_GPU is not set.
    """
    if requested not in CHOICES:
        raise DeviceError(f"device must be one of {', '.join(CHOICES)}; got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not cuda_usable()):
        return torch.device("cpu")
    if not cuda_usable():
        raise DeviceError(f"device cuda was asked for, but {_why_no_gpu()}; use --device cpu")
    count = torch.cuda.device_count()
    if local_size > count and not env.get("PLAIT_SHARE_GPU"):
        raise DeviceError(
            f"this host runs {local_size} ranks but has {count} GPU(s); run at most {count} "
            "ranks per host, set PLAIT_SHARE_GPU=1 to let ranks share GPUs, or use --device cpu"
        )
    return torch.device("cuda", local_rank % count)


def select(local_rank: int, local_size: int) -> torch.device:
    """Resolve PLAIT_DEVICE for this rank, make it the current CUDA device, and remember it
    as the job's device (what `plait.device()` returns). Called by `plait.init()`."""
    global _job_device, _local_ranks
    device = resolve(env.get("PLAIT_DEVICE"), local_rank, local_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        version = nccl_version()
        if local_size > torch.cuda.device_count() and version and version >= SHARED_GPU_NCCL:
            # NCCL >= 2.30 lets ranks share a GPU when asked (PLAIT_SHARE_GPU=1 was)
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    _job_device, _local_ranks = device, local_size
    return device


def local_ranks() -> int:
    """How many ranks of the job run on this host (1 before plait.init())."""
    return _local_ranks


def device() -> torch.device:
    """The device `plait.init()` chose for this rank (cpu before it ran)."""
    return _job_device

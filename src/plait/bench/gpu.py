"""What `plait bench ... --device cuda` shares: the check before launching, the workers'
environment, whether NCCL can run here, the facts a report names, and CUDA timing.

The parent side (NAME/job.py) calls `prepare` only for --device cuda, and torch is imported
inside the functions that need it, so the CPU benchmarks' parents stay torch-free.
"""

from __future__ import annotations

import time
from typing import Any


def prepare(local_ranks: int) -> tuple[dict[str, str], str | None]:
    """Before launching `local_ranks` CUDA workers on this host: their extra environment, and
    why NCCL cannot run among them (None where it can).

    Raises:
        DeviceError: no GPU is visible, or there are fewer GPUs than ranks and
            PLAIT_SHARE_GPU is not set (plait.devices says which, in one line).
    """
    import torch

    from plait import devices

    devices.resolve("cuda", 0, local_ranks)  # what plait.init() will check on every rank
    env = {"PLAIT_DEVICE": "cuda"}
    if local_ranks > torch.cuda.device_count():
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env, devices.nccl_problem(local_ranks)


def facts(device: Any) -> dict[str, Any]:
    """What a report names: the GPU, how many this host has, torch's, CUDA's, NCCL's versions."""
    import torch

    from plait import devices

    version = devices.nccl_version()
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None if version is None else ".".join(map(str, version)),
    }


def describe(facts: dict[str, Any], ranks: int) -> str:
    """One line of a report: the device and versions the numbers were taken on."""
    share = f", {ranks} ranks sharing them" if ranks > facts["gpus"] else ""
    return (
        f"device: {facts['gpus']} x {facts['gpu']}{share}; torch {facts['torch']}, "
        f"CUDA {facts['cuda']}, NCCL {facts['nccl'] or 'none'}"
    )


def clock(device: Any) -> float:
    """time.perf_counter() once `device`'s queued GPU work has finished (CUDA kernels run
    after the host call returns: a timing must wait for them at both ends)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

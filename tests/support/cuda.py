"""Worlds on this machine's GPUs: their environment, sharing one GPU where there is only one."""

from __future__ import annotations

import pytest
import torch

from plait.devices import nccl_problem

RANKS = 2


def world_env(transport: str) -> dict[str, str]:
    """Two ranks on this machine's GPUs, sharing one if it has one, CUDA tensors by `transport`."""
    if transport == "nccl":
        problem = nccl_problem(RANKS)
        if problem is not None:
            pytest.skip(f"NCCL cannot run {RANKS} ranks here: {problem}")
    return {
        "PLAIT_TIMEOUT": "60",  # NCCL's first connection takes seconds
        "PLAIT_DEVICE": "cuda",
        "PLAIT_SHARE_GPU": "1",
        "PLAIT_CUDA_TRANSPORT": transport,
        "NCCL_MULTI_RANK_GPU_ENABLE": "1",  # read by NCCL >= 2.30 only, where ranks share a GPU
    }


def gpu_env() -> dict[str, str]:
    """Two or more ranks on this machine's GPUs, sharing one where there is only one."""
    env = {"PLAIT_TIMEOUT": "120", "PLAIT_DEVICE": "cuda", "PLAIT_SHARE_GPU": "1"}
    if torch.cuda.device_count() < 2:  # NCCL: "duplicate GPU" for two ranks on one
        env["PLAIT_CUDA_TRANSPORT"] = "staged"
    return env

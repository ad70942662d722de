"""Training on GPUs: DataParallel and the meshes with CUDA tensors.

Every test here needs a CUDA GPU (`@pytest.mark.cuda`; conftest.py skips them where none is
visible) and is written for a machine with just one: two ranks share it (PLAIT_SHARE_GPU=1),
and since NCCL refuses two ranks on one GPU, their CUDA tensors then travel through pinned
host memory over plait's engine (PLAIT_CUDA_TRANSPORT=staged); with two GPUs or more, each
rank has its own and NCCL carries them.

The checks mirror the CPU ones: DataParallel against a one-process reference on the same
GPU (tests/world/test_data_parallel.py), meshes against one process
(tests/world/test_train_mesh.py). `plait train --device cuda` for every strategy and mesh
shape is in tests/e2e/test_train_cuda_command.py; the parameter server's staging in
tests/unit/test_ps_staging_cuda.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait import Communicator, DataParallel
from plait.train.config import TrainConfig
from plait.train.loop import train
from support.cuda import gpu_env
from support.dp_reference import Branchy, equivalence_run
from support.world import run_world

pytestmark = pytest.mark.cuda


# ------------------------------------------------------------ DataParallel on the GPU
def dp_equivalence(comm: Communicator, opt_name: str, dtype: torch.dtype, bucket_mb: float,
                   overlap: bool) -> dict[str, Any]:  # fmt: skip
    """Largest parameter difference to the reference on the same GPU after 5 steps; where
    the gradients and parameters ended up."""
    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32, as the reference's
    diff, dp = equivalence_run(comm, opt_name, dtype, bucket_mb, overlap, plait.device())
    return {
        "diff": diff,
        "params": sorted({str(p.device) for p in dp.module.parameters()}),
        "grads": sorted({str(p.grad.device) for p in dp.module.parameters() if p.grad is not None}),
    }


def dp_unused_and_buffers(comm: Communicator) -> dict[str, Any]:
    """find_unused_parameters' flags and BatchNorm's buffer broadcast, on the GPU."""
    gpu = plait.device()
    x = torch.ones(3, 4, dtype=torch.float64, device=gpu)
    dp = DataParallel(Branchy().to(gpu), comm, find_unused_parameters=True)
    dp(x, branch=comm.rank == 0).sum().backward()  # `sometimes` used on rank 0 only
    out: dict[str, Any] = {
        "sometimes": dp.module.sometimes.bias.grad.tolist(),
        "used": dp.module.used.bias.grad.tolist(),
    }
    torch.manual_seed(0)
    bn = DataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(gpu), comm)
    bn(torch.randn(8, 3, device=gpu) * (comm.rank + 1))  # statistics differ across ranks
    bn.eval()
    out["buffers"] = bn(torch.ones(2, 3, device=gpu)).flatten().tolist()  # rank 0's again
    return out


GPT = {"model": "gpt", "data": "synthetic", "steps": 4, "batch_size": 8, "eval_every": 0,
       "log_every": 4, "device": "cuda"}  # fmt: skip
SHAPES = [{"dp": 2}, {"pp": 2, "chunks": 2}, {"tp": 2}]  # dp 2 alone is DataParallelStep


def _train(comm: Communicator, options: dict[str, Any]) -> Any:
    return train(TrainConfig.from_options({**options, "workers": comm.size}), comm).figures()


def battery(comm: Communicator) -> dict[str, Any]:
    alone = comm.split(ranks=[0])  # the other rank waits for rank 0 in its next collective
    return {
        "device": str(plait.device()),
        "sgd-f64": dp_equivalence(comm, "sgd", torch.float64, 0.0005, True),
        "adam-f64-after-backward": dp_equivalence(comm, "adam", torch.float64, 0.0005, False),
        "sgd-f32-one-bucket": dp_equivalence(comm, "sgd", torch.float32, 25, True),
        "unused+buffers": dp_unused_and_buffers(comm),
        "one": _train(alone, GPT) if alone is not None else None,
        "meshes": [_train(comm, {**GPT, **shape}) for shape in SHAPES],
    }


@pytest.fixture(scope="module")
def two_ranks_on_gpu() -> list[dict[str, Any]]:
    return run_world(2, battery, timeout=400, env=gpu_env())


@pytest.mark.timeout(480)
def test_data_parallel_on_the_gpu_matches_one_process(
    two_ranks_on_gpu: list[dict[str, Any]],
) -> None:
    for r in two_ranks_on_gpu:
        assert r["device"].startswith("cuda:")
        for key in ("sgd-f64", "adam-f64-after-backward"):
            assert r[key]["diff"] < 1e-12, (key, r[key])
        assert r["sgd-f32-one-bucket"]["diff"] < 1e-5, r["sgd-f32-one-bucket"]
        for key in ("sgd-f64", "adam-f64-after-backward", "sgd-f32-one-bucket"):
            assert r[key]["params"] == r[key]["grads"] == [r["device"]], (key, r[key])
        extra = r["unused+buffers"]
        assert extra["sometimes"] == pytest.approx([3 / 2] * 2)  # rank 0's 3, averaged with 0
        assert extra["used"] == pytest.approx([3.0] * 2)
    assert two_ranks_on_gpu[0]["unused+buffers"]["buffers"] == pytest.approx(
        two_ranks_on_gpu[1]["unused+buffers"]["buffers"]
    )


@pytest.mark.timeout(480)
@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_each_shape_on_the_gpu_trains_like_one_process(
    two_ranks_on_gpu: list[dict[str, Any]], index: int
) -> None:
    one = two_ranks_on_gpu[0]["one"]
    got = [r["meshes"][index] for r in two_ranks_on_gpu]
    print(f"{SHAPES[index]}\n  one process: {one['losses']}\n  2 ranks: {got[0]['losses']}")
    assert one["device"] == got[0]["device"] == "cuda"
    torch.testing.assert_close(got[0]["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    assert got[1]["losses"] == got[0]["losses"]
    assert all(math.isfinite(v) for v in got[0]["losses"])


# ------------------------------------------------ the parameter server's pinned copies


# ----------------------------------------------------------- plait train --device cuda

"""The "plait" torch backend with CUDA tensors (scripts/gpu-check.sh runs these; conftest.py
skips them where no GPU is visible). Two ranks share the machine's GPU where it has one, so
CUDA tensors travel through pinned host memory (staged) unless NCCL can take both ranks.

Each check trains the same torch code on the plait group with CUDA tensors and on a gloo
group with CPU copies of the model (the reference), and a rank killed in DDP's backward is
named on the survivor as on CPU (tests/world/test_torch_backend.py).
"""

from __future__ import annotations

import copy
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from support.cuda import world_env
from support.world import run_world

pytestmark = pytest.mark.cuda


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _train(model: torch.nn.Module, device: str, rank: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        model(x.to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _ddp_and_fsdp(comm: Any) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, device = dist.get_rank(), f"cuda:{torch.cuda.current_device()}"
    gloo = dist.new_group(backend="gloo")
    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t)
    assert t.device.type == "cuda" and t.tolist() == [3.0] * 3
    base = _model()
    on_gpu = _train(DDP(copy.deepcopy(base).to(device)), device, rank)
    on_cpu = _train(DDP(copy.deepcopy(base), process_group=gloo), "cpu", rank)
    for name, value in on_gpu.items():
        assert_close(value, on_cpu[name], msg=f"DDP {name}")
    sharded = copy.deepcopy(base).to(device)
    fully_shard(sharded, mesh=DeviceMesh.from_group(dist.group.WORLD, "cuda"))
    reference = copy.deepcopy(base)
    fully_shard(reference, mesh=DeviceMesh.from_group(gloo, "cpu"))
    opt_g = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        for model, opt, dev in ((sharded, opt_g, device), (reference, opt_c, "cpu")):
            model(x.to(dev)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert_close(a.full_tensor().cpu(), b.full_tensor(), msg=f"FSDP2 {name}")
    return "ok"


@pytest.mark.parametrize("transport", ["staged", "nccl"])
def test_ddp_and_fsdp2_on_cuda_tensors_match_gloo_on_cpu(transport: str) -> None:
    env = world_env(transport)
    assert run_world(2, _ddp_and_fsdp, env=env, init="torch:plait", timeout=180) == ["ok"] * 2


def _dies_in_backward(comm: Any) -> tuple[str, float] | None:
    rank, device = dist.get_rank(), f"cuda:{torch.cuda.current_device()}"
    model = DDP(_model().to(device))
    step = [0]

    def maybe_die(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model.module[0].weight.register_hook(maybe_die)
    x = torch.randn(4, 8, device=device)
    started = 0.0
    try:
        for step[0] in range(6):
            started = time.monotonic()
            model(x).sum().backward()
            torch.cuda.synchronize()
    except Exception as e:
        return str(e), time.monotonic() - started
    return None


@pytest.mark.parametrize("transport", ["staged", "nccl"])
def test_rank_killed_in_ddp_backward_on_cuda_is_named(transport: str) -> None:
    env = {**world_env(transport), "PLAIT_HEARTBEAT_TIMEOUT": "2"}
    results = run_world(
        2, _dies_in_backward, env=env, init="torch:plait", tolerate=[1], timeout=120
    )
    assert results[0] is not None, "rank 0's backward did not raise"
    message, seconds = results[0]
    assert "rank 1 failed" in message and seconds < 15, (seconds, message)

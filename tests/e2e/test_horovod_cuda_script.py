"""The usual Horovod script (set_device, .cuda(), DistributedOptimizer, the broadcasts) on GPUs
under `plait run`, once per way CUDA tensors travel (PLAIT_CUDA_TRANSPORT).

Marked `cuda`: skipped where no GPU is visible (tests/conftest.py); "nccl" is skipped with
the reason where NCCL cannot join two ranks on this machine's GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cuda import RANKS, world_env

pytestmark = pytest.mark.cuda

TRANSPORTS = ["nccl", "staged"]


SCRIPT = """
import torch
import plait.horovod.torch as hvd

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())  # ranks may share a GPU
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
torch.manual_seed(1 + hvd.rank())  # each rank its own data
for step in range(20):
    x = torch.randn(32, 8, device="cuda")
    y = x[:, :2].sum(1, keepdim=True).repeat(1, 2)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    loss = hvd.allreduce(loss.detach(), name="loss")
    if hvd.rank() == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat.reshape(1, -1))
assert torch.equal(everyone[0], everyone[-1]), "the replicas diverged"
print(f"rank {hvd.rank()} done on {flat.device}", flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_usual_horovod_script_on_gpus(transport: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **world_env(transport)}
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", str(RANKS), str(script)],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    for r in range(RANKS):
        assert f"rank {r} done on cuda" in res.stdout, res.stdout

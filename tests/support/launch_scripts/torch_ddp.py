"""An unchanged torch program: DDP on the backend named in argv[1] (default "plait"). It
never imports plait: torch's entry point registers the backend. With argv[2] "leave" it ends
without destroy_process_group and with an async all_reduce's future left pending: its
ranks must still end by the interpreter's own exit, status 0, never by a signal."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

backend = sys.argv[1] if len(sys.argv) > 1 else "plait"
leave = sys.argv[2:3] == ["leave"]
dist.init_process_group(backend)
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
total = torch.tensor([loss.item()])
dist.all_reduce(total)
# one write of the whole line: the ranks share torchrun's stdout, and with PYTHONUNBUFFERED
# print() writes the text and its newline apart, so another rank's line could come between
sys.stdout.write(
    f"OK rank={rank} size={size} backend={dist.get_backend()} loss={total.item():.6f}\n"
)
sys.stdout.flush()
if leave:
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    del fut
else:
    dist.destroy_process_group()

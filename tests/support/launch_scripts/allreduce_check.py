"""Run under a launcher: checks an allreduce over the whole world and prints a verdict."""

import torch

import plait

comm = plait.init()
total = comm.allreduce(torch.tensor([float(comm.rank + 1)]))
expected = comm.size * (comm.size + 1) / 2
assert total.item() == expected, (total, expected)
print(f"OK rank={comm.rank} size={comm.size} local_rank={comm.local_rank}", flush=True)
plait.shutdown()

"""Run under a multi-node launcher: checks plait's view of the hosts and a cross-host allreduce.

The expected layout comes from the launcher's variables (GROUP_WORLD_SIZE nodes of
LOCAL_WORLD_SIZE ranks, this one on node GROUP_RANK); the host identity plait uses is
PLAIT_NODE_ID, set per host by the test.
"""

import os

import torch

import plait

comm = plait.init()
nnodes = int(os.environ["GROUP_WORLD_SIZE"])
nproc = int(os.environ["LOCAL_WORLD_SIZE"])
assert comm.size == nnodes * nproc, (comm.size, nnodes, nproc)
assert comm.rank == int(os.environ["RANK"])
assert comm.num_nodes == nnodes, comm
assert comm.local_size == nproc, comm
assert comm.node_rank == int(os.environ["GROUP_RANK"]), comm
assert comm.local_rank == int(os.environ["LOCAL_RANK"]), comm
for algorithm in ("ring", "native"):
    # rank r contributes arange(n) + r: the sum is size * arange(n) + size * (size - 1) / 2
    n = 1 << 16
    total = comm.allreduce(torch.arange(n, dtype=torch.float64) + comm.rank, algorithm=algorithm)
    expected = comm.size * torch.arange(n, dtype=torch.float64) + comm.size * (comm.size - 1) / 2
    torch.testing.assert_close(total, expected, rtol=0, atol=0)
    print(f"allreduce {algorithm} ok", flush=True)
print(
    f"OK rank={comm.rank} size={comm.size} node_rank={comm.node_rank} "
    f"num_nodes={comm.num_nodes} local_rank={comm.local_rank} local_size={comm.local_size} "
    f"node={os.environ['PLAIT_NODE_ID']}",
    flush=True,
)
plait.shutdown()

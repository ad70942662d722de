"""Run under a multi-node launcher: checks plait's view of the hosts, a cross-host allreduce
and a ZeRO-3 step across the hosts.

The expected layout comes from the launcher's variables (GROUP_WORLD_SIZE nodes of
LOCAL_WORLD_SIZE ranks, this one on node GROUP_RANK); the host identity plait uses is
PLAIT_NODE_ID, set per host by the test.
"""

import os

import torch

import plait
from plait.comm.dispatch import auto

comm = plait.init()
nnodes = int(os.environ["GROUP_WORLD_SIZE"])
nproc = int(os.environ["LOCAL_WORLD_SIZE"])
assert comm.size == nnodes * nproc, (comm.size, nnodes, nproc)
assert comm.rank == int(os.environ["RANK"])
assert comm.num_nodes == nnodes, comm
assert comm.local_size == nproc, comm
assert comm.node_rank == int(os.environ["GROUP_RANK"]), comm
assert comm.local_rank == int(os.environ["LOCAL_RANK"]), comm
two_level = comm.num_nodes > 1 and comm.local_size > 1
algorithms = ["ring", "native"] + (["hierarchical", "auto"] if two_level else [])
for algorithm in algorithms:
    # rank r contributes arange(n) + r: the sum is size * arange(n) + size * (size - 1) / 2;
    # 600_001 float64 (4.8 MB) is larger than a shared-memory slot made for 1 MB, and odd
    for n in (1, 1 << 16, 600_001):
        x = torch.arange(n, dtype=torch.float64) + comm.rank
        total = comm.allreduce(x, algorithm=algorithm)
        expected = (
            comm.size * torch.arange(n, dtype=torch.float64) + comm.size * (comm.size - 1) / 2
        )
        # exact, with torch.equal: torch.testing.assert_close would import sympy and
        # torch.distributed.tensor in every rank on its first call (~1 s of CPU each)
        assert total.dtype == expected.dtype and torch.equal(total, expected), algorithm
    print(f"allreduce {algorithm} ok", flush=True)
# ZeRO-3 across hosts: its units' storage is resized to 0 after the broadcast and every
# gather, which a tensor the TCP path had viewed through numpy could not do (the known
# fault of `plait train --zero 3` on two simulated hosts)
sdp = plait.ShardedDataParallel(torch.nn.Linear(8, 8), stage=3, comm=comm)
sdp(torch.ones(2, 8)).sum().backward()
assert sdp.shards[0].grad is not None
print("zero3 ok", flush=True)
if two_level:
    assert auto.choose("allreduce", 16 << 20, comm.topology) == "hierarchical"
    # the structure: inside a host nothing goes through the sockets, across hosts this
    # rank sends only to the peer of the same local rank (what it receives may include a
    # fast peer's first message of the next call, so only sends are counted)
    x = torch.ones(1 << 18)
    before = comm.engine.counts()
    comm.allreduce(x, algorithm="hierarchical", check=False)
    after = comm.engine.counts()
    talked = {p for p in after if after[p][0] != before.get(p, (0, 0))[0]}
    peers = {r for r in range(comm.size) if r % comm.local_size == comm.local_rank} - {comm.rank}
    assert talked == peers, (talked, peers)
    print("hierarchical structure ok", flush=True)
    # as on GPUs: both levels over batched point-to-point (here gloo's, NCCL's order kept)
    os.environ["PLAIT_TEST_LINK"] = "group"  # read by a communicator when it is made
    over_links = comm.split(color=0)  # every rank, the same hosts
    del os.environ["PLAIT_TEST_LINK"]
    x = torch.arange(1001, dtype=torch.float64) + comm.rank
    total = over_links.allreduce(x, algorithm="hierarchical")
    expected = comm.size * torch.arange(1001, dtype=torch.float64) + comm.size * (comm.size - 1) / 2
    assert total.dtype == expected.dtype and torch.equal(total, expected)
    print("hierarchical over point-to-point ok", flush=True)
    # the two halves on their own, uneven blocks, against the flat ring's exact answers
    for rows in (5, 40_001):  # 40_001 x 3 float64 exceeds a 1 MB slot: windows
        x = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3) + comm.rank
        want = comm.reduce_scatter(x, algorithm="ring")
        for algorithm in ("hierarchical", "auto"):
            assert torch.equal(comm.reduce_scatter(x, algorithm=algorithm), want), algorithm
        mine = torch.full((comm.rank + rows % 3, 2), float(comm.rank))
        want = comm.allgather(mine, algorithm="ring")
        for algorithm in ("hierarchical", "auto"):
            assert torch.equal(comm.allgather(mine, algorithm=algorithm), want), algorithm
    print("hierarchical reduce_scatter and allgather ok", flush=True)
print(
    f"OK rank={comm.rank} size={comm.size} node_rank={comm.node_rank} "
    f"num_nodes={comm.num_nodes} local_rank={comm.local_rank} local_size={comm.local_size} "
    f"node={os.environ['PLAIT_NODE_ID']}",
    flush=True,
)
plait.shutdown()

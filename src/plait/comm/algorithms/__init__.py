"""plait's collective algorithms: every row of the routing table (dispatch/routes.py).

Each module lists its rows in `ROUTES` and the rows that run on a GPU over NCCL in
`ON_DEVICE`; a new algorithm is one module and its line in the table's `SOURCES`. The
schedules over point-to-point messages work in place on 1-D contiguous buffers through a
Channel (core/channel.py), so each is its own row (a call's context is a Channel):

- `ring`: reduce-scatter, all-gather and pipelined allreduce (bandwidth-optimal, p-1 latency).
- `halving_doubling`: Rabenseifner's allreduce with the non-power-of-two fold (lg p latency).
- `tree`: binomial reduce, broadcast and allreduce (small messages).
- `direct`: gather, scatter, alltoall, small all-gather and the dissemination barrier (the
  only algorithm of those collectives: no rows, called without the table).

The others ask more of their call, through the Protocol of context.py:

- `shm`: collectives through a shared-memory arena among the ranks of one host.
- `hierarchical`: BlueConnect's two-level allreduce (shared memory inside each host, a flat
  algorithm between hosts).
- `native`: torch.distributed's own collectives (gloo; NCCL's on CUDA tensors).

Reduction ops are "sum", "prod", "min" and "max"; "avg" is the caller's business.
"""

from plait.comm.algorithms import direct, halving_doubling, ring, tree

__all__ = ["direct", "halving_doubling", "ring", "tree"]

"""plait's own collective algorithms, written as schedules over point-to-point messages.

Each module works in place on 1-D contiguous buffers through a `plait.comm.core.channel.Channel`:

- `ring`: reduce-scatter, all-gather and pipelined allreduce (bandwidth-optimal, p-1 latency).
- `halving_doubling`: Rabenseifner's allreduce with the non-power-of-two fold (lg p latency).
- `tree`: binomial reduce, broadcast and allreduce (small messages).
- `direct`: gather, scatter, alltoall, small all-gather and the dissemination barrier.
- `hierarchical`: BlueConnect's two-level allreduce (shared memory inside each host, a flat
  algorithm between hosts); imported on its own, as it builds on `plait.comm.shm`.

Reduction ops are "sum", "prod", "min" and "max"; "avg" is the caller's business. Each
module but `direct` lists its rows of the routing table in `ROUTES` (see comm/routes.py):
a channel algorithm is its own row, since a call's Context is a Channel.
"""

from plait.comm.algorithms import direct, halving_doubling, ring, tree

__all__ = ["direct", "halving_doubling", "ring", "tree"]

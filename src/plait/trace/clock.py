"""Each rank's clock offset to rank 0's, estimated NTP-style at start-up.

Rank r sends its time t0 to rank 0, rank 0 answers with its time t1, rank r reads t2 on
the answer. If the two legs take equally long, rank 0's clock read t1 when rank r's read
(t0 + t2) / 2, so offset = t1 - (t0 + t2) / 2, and the error is at most the round trip
over two (the legs' asymmetry can hide anywhere in it). Of ROUNDS samples the one with the
smallest round trip is kept (NTP's clock filter): its bound is the tightest, and a sample
delayed by a scheduler hiccup on 2 busy cores is simply not the minimum.

On one host the ranks share CLOCK_MONOTONIC, so the offsets come out within their
uncertainty of 0 (a few tens of microseconds over Unix sockets): the estimate is what keeps
ranks of several hosts aligned. Drift over a long run is not followed (a one-time sync);
NTP-disciplined clocks drift by ppm, 1 ms per ~17 minutes at 1 ppm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plait.trace.recorder import now

ROUNDS = 16  # samples per rank; 16 round trips of ~100 us each cost a few ms per rank
TAG = 0x7ACE  # the ping-pong's message tag (point-to-point; no collective is used)


@dataclass(frozen=True)
class Offset:
    """This rank's clock + `seconds` = rank 0's clock, within +- `uncertainty` seconds."""

    seconds: float = 0.0
    uncertainty: float = 0.0
    rtt: float = 0.0  # the round trip of the sample kept


def sync(comm: Any, rounds: int = ROUNDS) -> Offset:
    """Estimate this rank's offset to rank 0 of `comm` (every rank calls it).

    Rank 0 answers each other rank in turn, `rounds` times; the pings are point-to-point
    sends of one float64, so this works on any communicator with send/recv.
    """
    if comm.size == 1:
        return Offset()
    buf = torch.zeros(1, dtype=torch.float64)
    if comm.rank == 0:
        for peer in range(1, comm.size):
            for _ in range(rounds):
                comm.recv(buf, peer, TAG)
                buf[0] = now()
                comm.send(buf, peer, TAG)
        return Offset()
    best: Offset | None = None
    for _ in range(rounds):
        t0 = now()
        buf[0] = t0
        comm.send(buf, 0, TAG)
        comm.recv(buf, 0, TAG)
        t2 = now()
        rtt = t2 - t0
        if best is None or rtt < best.rtt:
            best = Offset(float(buf[0]) - (t0 + t2) / 2, rtt / 2, rtt)
    assert best is not None
    return best

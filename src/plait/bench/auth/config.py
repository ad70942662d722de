"""`plait bench auth`: what the job secret costs. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, json_field
from plait.errors import ConfigError
from plait.options import option

#: the bar: authenticated / plain per-message figures at most this (the issue's "negligible")
PER_MESSAGE_BAR = 1.10


@dataclass(kw_only=True)
class AuthBenchConfig:
    """auth: what proving the job secret costs, each figure beside its plain counterpart.

    Engine: a connection with the challenge-response handshake against a connect plus the
    old one-way hello. Store: a signed set+get against torch's store alone. Parameter
    server: a new worker's first answered request, a 1 KB pull and a 4 MB push_pull, with
    the job key and without (the same server and worker code). All in one process on
    loopback, the two sides in turns, medians over --repeats; then plait.init() of a
    4-rank job for scale. The bar: the parameter server's per-message ratios (1 KB pull,
    4 MB push_pull) at most 1.10. Set-up is reported, not barred: a handshake is once per
    pair of ranks (or worker and server) per job, and plait reads the store at start-up
    only (a few keys a rank), never per step.
    """

    repeats: int = field(default=7, metadata=option("rounds of every measurement"))
    connections: int = field(default=200, metadata=option("engine connections per round"))
    trips: int = field(default=500, metadata=option("store set+get pairs per round"))
    inits: int = field(default=3, metadata=option("4-rank plait.init() runs (0: skip)"))
    json: str | None = json_field()

    def __post_init__(self) -> None:
        at_least_1(repeats=self.repeats, connections=self.connections, trips=self.trips)
        if self.inits < 0:
            raise ConfigError(f"--inits must be >= 0; got {self.inits}")

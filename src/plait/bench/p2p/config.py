"""`plait bench p2p`: its options. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import SIZES, at_least_1, json_field, markdown_field, sizes
from plait.errors import ConfigError
from plait.options import option
from plait.sizes import parse_sizes

#: The ways `plait bench p2p` sends: torch.distributed's, plait over its socket, plait's pipes.
MODES = ("torch", "socket", "shm")


@dataclass(kw_only=True)
class P2PConfig:
    """send/recv on one host: torch.distributed vs plait (socket, shared memory).

    Pairs of ranks (0-1, 2-3, ...) bounce a float32 message back and forth with
    torch.distributed (gloo), with plait over its Unix socket, and with plait through its
    shared-memory pipes; report the median one-way time over repeats, the bandwidth, and
    speed ratios paired by repeat.
    """

    nproc: int = field(default=2, metadata=option("ranks, an even number", aliases=("-n",)))
    sizes: str = field(default=SIZES, metadata=option("bytes"))
    repeats: int = field(default=7, metadata=option("timed repeats per cell"))
    budget: float = field(default=3.0, metadata=option("seconds per size"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        if self.nproc < 2 or self.nproc % 2:
            raise ConfigError(f"-n must be an even number >= 2 (ranks pair up); got {self.nproc}")
        at_least_1(repeats=self.repeats)
        sizes(self.sizes)

    @property
    def size_list(self) -> list[int]:
        """--sizes in bytes."""
        return parse_sizes(self.sizes)

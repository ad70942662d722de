"""`plait bench collectives` and `plait bench p2p`: the communicator's own operations."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.configs.fields import (
    SIZES,
    at_least_1,
    device_field,
    device_known,
    json_field,
    markdown_field,
    sizes,
    subset,
)
from plait.bench.units import ALGORITHMS, parse_sizes
from plait.errors import ConfigError
from plait.options import option


@dataclass(kw_only=True)
class CollectivesConfig:
    """allreduce: every plait algorithm vs torch.distributed, side by side.

    Time allreduce (float32) for every algorithm and torch.distributed's own, in one run;
    report medians over repeats and the ratio to torch. With --device cuda each rank's
    tensors are on its GPU: torch is NCCL's allreduce, native plait's call of it, and plait's
    algorithms run twice, over NCCL point-to-point and staged through host memory
    (PLAIT_CUDA_TRANSPORT=nccl, then staged: one launch each).
    """

    nproc: int = field(default=4, metadata=option("ranks (per host with --hosts)", aliases=("-n",)))
    hosts: int = field(
        default=1,
        metadata=option(
            "simulate H hosts with network namespaces (needs root), -n ranks on each", metavar="H"
        ),
    )
    link_rate: str | None = field(
        default=None,
        metadata=option(
            "with --hosts: limit each host's link, e.g. 1gbit (tc tbf)", metavar="RATE"
        ),
    )
    sizes: str = field(default=SIZES, metadata=option("bytes per rank"))
    algorithms: str = field(
        default=",".join(ALGORITHMS),
        metadata=option(f"comma-separated subset of {','.join(ALGORITHMS)}", default_text="all"),
    )
    repeats: int = field(default=7, metadata=option("timed repeats per cell"))
    budget: float = field(default=4.0, metadata=option("seconds of timing per size"))
    device: str = device_field("where each rank's tensors are: cpu, or cuda (its GPU; NCCL)")
    calibrate: bool = field(
        default=False,
        metadata=option(
            "first fit each algorithm's cost line for this world size and save it; "
            "algorithm='auto' uses it from then on"
        ),
    )
    json: str | None = json_field()
    from_json: str | None = field(
        default=None,
        metadata=option(
            "measure nothing: print the tables of an earlier --json file", metavar="FILE"
        ),
    )
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n must be >= 1; got {self.nproc}")
        if self.hosts < 1:
            raise ConfigError(f"--hosts must be >= 1; got {self.hosts}")
        if self.link_rate and self.hosts == 1:
            raise ConfigError("--link-rate limits the links between hosts: add --hosts H (H >= 2)")
        device_known(self.device)
        if self.device == "cuda" and self.hosts > 1:
            raise ConfigError(
                "--device cuda runs on this host's GPUs; --hosts simulates hosts with network "
                "namespaces, which share them: drop --hosts"
            )
        at_least_1(repeats=self.repeats)
        subset("algorithms", self.algorithms, ALGORITHMS)
        sizes(self.sizes)

    @property
    def size_list(self) -> list[int]:
        """--sizes in bytes."""
        return parse_sizes(self.sizes)

    @property
    def algorithm_list(self) -> list[str]:
        return [a for a in self.algorithms.split(",") if a]


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

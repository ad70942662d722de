"""`plait bench collectives`: its options (no torch: the routing table is read only to check
algorithms named on the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import (
    SIZES,
    at_least_1,
    device_field,
    device_known,
    json_field,
    markdown_field,
    sizes,
    subset,
)
from plait.errors import ConfigError
from plait.options import option
from plait.sizes import parse_sizes

ALL = "all"  # --algorithms: every one (algorithms())
PEER = "torch"  # torch.distributed's all_reduce, no plait code on its path


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
        default=ALL,
        metadata=option(
            f"comma-separated subset of {PEER}, auto and the routing table's allreduce rows "
            "(native, ring, ...; an unknown name lists them)",
            default_text="all",
        ),
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
        if self.algorithms != ALL:  # reads the routing table: torch (only when names are given)
            subset("algorithms", self.algorithms, algorithms())
        sizes(self.sizes)

    @property
    def size_list(self) -> list[int]:
        """--sizes in bytes."""
        return parse_sizes(self.sizes)

    @property
    def algorithm_list(self) -> list[str]:
        """--algorithms in the order given; all: the peer, the routing table's allreduce rows
        in its order, and auto."""
        if self.algorithms == ALL:
            return algorithms()
        return [a for a in self.algorithms.split(",") if a]


def algorithms() -> list[str]:
    """What `plait bench collectives` can time: torch.distributed's own allreduce (the peer),
    then plait's: every allreduce row of the routing table, in its order, and auto."""
    from plait.comm.dispatch import routes

    auto, *rows = routes.ACCEPTED["allreduce"]
    return [PEER, *rows, auto]

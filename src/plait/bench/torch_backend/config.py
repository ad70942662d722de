"""`plait bench torch-backend`: its options, what it measures, and the bars. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import (
    at_least_1,
    batch_divides,
    device_field,
    device_known,
    ints,
    json_field,
    markdown_field,
    subset,
)
from plait.errors import ConfigError
from plait.options import option
from plait.train.recipes import MODELS

#: What each world measures: a DDP step and an FSDP2 step per workload, and once per world
#: the latency of a small all_reduce
MEASURES = ("ddp", "fsdp2", "latency")
#: --device -> the peer "plait" takes turns with: torch's own backend for that device
PEERS = {"cpu": "gloo", "cuda": "nccl"}
LATENCY_BYTES = 16  # the small all_reduce: 4 float32


@dataclass(frozen=True)
class Bar:
    """A bar of issue 32: peer time / plait time at least `at_least` for `measure` against
    `peer`, on `workloads` (None: every workload)."""

    peer: str
    measure: str
    at_least: float
    workloads: tuple[str, ...] | None = None
    text: str = ""


#: Reported as met or not: a benchmark, not a test.
BARS = (
    # where communication shows; gpt's step is mostly compute on this machine
    Bar("gloo", "ddp", 1.2, ("cnn", "wide"), "DDP >= 1.2x gloo (cnn, wide)"),
    # gloo has no reduce-scatter: torch emulates it with a full allreduce (pytorch #118911)
    Bar("gloo", "fsdp2", 1.5, None, "FSDP2 >= 1.5x gloo"),
    Bar("gloo", "latency", 2.0, None, "16 B all_reduce <= 0.5x gloo's time"),
    Bar("nccl", "ddp", 1 / 1.05, None, "DDP within 5% of nccl"),  # plait <= 1.05 x nccl
)


def bar_for(peer: str, measure: str, workload: str) -> Bar | None:
    """The bar a row (plait against `peer`, `measure` on `workload`) is held to, if any."""
    for bar in BARS:
        if (bar.peer, bar.measure) == (peer, measure) and (
            bar.workloads is None or workload in bar.workloads
        ):
            return bar
    return None


@dataclass(kw_only=True)
class TorchBackendBenchConfig:
    """torch.distributed backend "plait" vs "gloo": DDP, FSDP2 and a small all_reduce.

    In one world per size, torch's default group is "plait" (dist.init_process_group) and
    a second group over the same ranks is "gloo" (dist.new_group); the same unchanged torch
    code runs on each, only the group differs: per workload a DDP step
    (DistributedDataParallel(model, process_group=g), forward, backward, SGD step) and an
    FSDP2 step (fully_shard per block, or per layer, then the root, on
    DeviceMesh.from_group(g)), each on a fresh copy of the model; and per world the
    latency of a 16-byte all_reduce. The two groups take turns each round (the order
    turned by one each round); a step's time is the slowest rank's, a round's the median
    of its steps, and the report gives medians over rounds and gloo / plait paired by
    round (> 1: plait is faster), with the bars of issue 32. With --device cuda each rank
    trains on its GPU and the peer is "nccl".
    """

    nproc: str = field(default="2,4", metadata=option("world sizes to run", aliases=("-n",)))
    workloads: str = field(
        default="cnn,wide,gpt", metadata=option(f"comma-separated subset of {','.join(MODELS)}")
    )
    measures: str = field(
        default=",".join(MEASURES),
        metadata=option(f"comma-separated subset of {','.join(MEASURES)}", default_text="all"),
    )
    global_batch: int = field(default=32, metadata=option("global batch"))
    steps: int = field(default=10, metadata=option("timed steps per way and round"))
    repeats: int = field(default=5, metadata=option("rounds"))
    warmup: int = field(default=3, metadata=option("untimed steps of each way first"))
    calls: int = field(default=500, metadata=option("timed all_reduce calls per way and round"))
    device: str = device_field("where each rank trains: cpu (peer gloo) or cuda (peer nccl)")
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("workloads", self.workloads, MODELS)
        subset("measures", self.measures, MEASURES)
        device_known(self.device)
        batch_divides(self.global_batch, ints("nproc", self.nproc))
        at_least_1(steps=self.steps, repeats=self.repeats, calls=self.calls)
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0; got {self.warmup}")

    @property
    def world_sizes(self) -> list[int]:
        return ints("nproc", self.nproc)

    @property
    def workload_list(self) -> list[str]:
        return self.workloads.split(",")

    @property
    def measure_list(self) -> list[str]:
        return self.measures.split(",")

    @property
    def peer(self) -> str:
        return PEERS[self.device]

"""`plait bench train`: its options. No torch."""

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
from plait.options import option
from plait.train.recipes import MODELS

#: The ways it trains (bench/wrapping.py's dp and ddp): plait.DataParallel, torch DDP
IMPLS = ("plait", "ddp")


@dataclass(kw_only=True)
class TrainBenchConfig:
    """training throughput: plait DataParallel vs torch DDP, side by side.

    Train the same model with plait.DataParallel and torch DistributedDataParallel in one
    run (same world size, global batch and gloo backend), in turns, and report samples/s
    of each and their ratio. With --device cuda each rank trains on its GPU and DDP uses
    NCCL.
    """

    workloads: str = field(
        default="gpt,cnn,wide", metadata=option(f"comma-separated subset of {','.join(MODELS)}")
    )
    nproc: str = field(default="2,4", metadata=option("world sizes to run", aliases=("-n",)))
    global_batch: int = field(default=32, metadata=option("global batch"))
    steps: int = field(default=10, metadata=option("timed steps per repeat"))
    repeats: int = field(default=5, metadata=option("repeats per cell"))
    warmup: int = field(
        default=3, metadata=option("untimed steps of each before timing", cli=False)
    )
    bucket_mb: float = field(default=25.0, metadata=option("bucket size in MB, both"))
    device: str = device_field("where each rank trains: cpu, or cuda (its GPU; DDP over NCCL)")
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("workloads", self.workloads, MODELS)
        device_known(self.device)
        batch_divides(self.global_batch, ints("nproc", self.nproc))
        at_least_1(steps=self.steps, repeats=self.repeats)

    @property
    def world_sizes(self) -> list[int]:
        return ints("nproc", self.nproc)

    @property
    def workload_list(self) -> list[str]:
        return self.workloads.split(",")

"""`plait bench memory`: its options, the ways it trains, and its exit status out of memory.
No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import (
    at_least_1,
    batch_divides,
    ints,
    json_field,
    markdown_field,
    size,
    subset,
)
from plait.errors import ConfigError
from plait.options import option

#: What trains side by side: plait's DataParallel and ZeRO stages, then torch's (the ways
#: of bench/wrapping.py)
IMPLS = ("dp", "stage1", "stage2", "stage3", "ddp", "ddp-zero", "fsdp2")
#: A rank that ran out of memory under --limit exits with this status
EXIT_OOM = 3
LIMIT_FACTOR = 3.0  # --limit: stage 3 trains >= 3x the parameters DataParallel can
PROBE_STEPS = 2  # --limit: steps per DataParallel probe; Adam's state exists from step 1
MAX_LAYERS = 1024  # --limit: DataParallel fitting more than this: the limit is too loose


@dataclass(kw_only=True)
class MemoryBenchConfig:
    """model-state memory: plait DataParallel and ZeRO stages 1-3 vs torch DDP, ZeRO, FSDP2.

    Train the same gpt (--layers x --width, fp32, AdamW) at the same global batch with
    plait.DataParallel, plait.ShardedDataParallel stages 1, 2 and 3, torch DDP, torch
    ZeroRedundancyOptimizer + DDP and torch FSDP2 (fully_shard per block, then the root),
    one job per way and world size (gloo), and report per rank the bytes of parameters,
    gradients and optimizer state counted from the tensors the rank holds, next to their
    formula (Ψ parameters), the peak process memory (ru_maxrss: torch's own included), and
    the median step time; then the bars, met or not. With --limit BYTES, instead: every
    rank lowers its own RLIMIT_DATA to BYTES and checkpoints the blocks' activations; find
    the most layers DataParallel trains at the largest --workers, then train a gpt of at
    least 3x its parameters with stage 3 (and with DataParallel, which runs out of memory).
    """

    workers: str = field(default="2,4", metadata=option("world sizes to run"))
    impls: str = field(
        default=",".join(IMPLS),
        metadata=option(f"comma-separated subset of {','.join(IMPLS)}", default_text="all"),
    )
    layers: int = field(default=8, metadata=option("gpt blocks"))
    width: int = field(default=512, metadata=option("gpt width (n_embd)"))
    heads: int = field(default=8, metadata=option("attention heads"))
    seq: int = field(default=64, metadata=option("tokens per sequence"))
    global_batch: int = field(default=8, metadata=option("sequences per step, over all ranks"))
    warmup: int = field(default=2, metadata=option("untimed steps first"))
    repeats: int = field(default=5, metadata=option("timed steps (the step time is their median)"))
    prefetch: int = field(default=1, metadata=option("stage 3: units all-gathered ahead"))
    limit: str | None = field(
        default=None,
        metadata=option(
            "instead of the table: the memory-limit demonstration under this RLIMIT_DATA "
            "per rank, e.g. 1500M",
            metavar="BYTES",
        ),
    )
    limit_steps: int = field(default=20, metadata=option("--limit: steps stage 3 trains"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("impls", self.impls, IMPLS)
        batch_divides(self.global_batch, ints("workers", self.workers))
        at_least_1(
            layers=self.layers, width=self.width, heads=self.heads, seq=self.seq,
            repeats=self.repeats, prefetch=self.prefetch, limit_steps=self.limit_steps,
        )  # fmt: skip
        if self.width % self.heads:
            raise ConfigError(
                f"--width {self.width} % --heads {self.heads} = {self.width % self.heads} "
                "!= 0: every head gets width / heads channels"
            )
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0; got {self.warmup}")
        if self.limit is not None:
            size("--limit", self.limit)

    @property
    def world_sizes(self) -> list[int]:
        return ints("workers", self.workers)

    @property
    def impl_list(self) -> list[str]:
        return self.impls.split(",")

    @property
    def limit_bytes(self) -> int | None:
        """--limit in bytes (K, M, G suffixes: powers of 1024); None without --limit."""
        return None if self.limit is None else size("--limit", self.limit)

"""`plait bench horovod`: the Horovod facade's newer features against their peers. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, json_field, markdown_field, sizes
from plait.errors import ConfigError
from plait.options import option

#: --ranks: Adasum pairs ranks by recursive halving, so it needs a power of 2
RANKS = (2, 4)

#: A case's kind -> its rows: (plait's way, the peer's way, what the peer is). The ways are
#: the names ranks.py times under; the report divides plait's time by the peer's.
PAIRS: dict[str, list[tuple[str, str, str]]] = {
    "allreduce": [("hvd.allreduce", "dist.all_reduce", "gloo")],
    "grouped": [
        ("hvd.grouped_allreduce", "dist.all_reduce each", "gloo, async_op=True, then waits"),
        ("hvd.grouped_allreduce", "flattened", "gloo, one buffer (fused by hand)"),
    ],
    "adasum": [("op=Adasum", "op=Average", "plait's Average (no Horovod build)")],
    "sparse": [
        ("hvd.sparse_allreduce", "dist.all_reduce", "gloo's sparse allreduce"),
        ("hvd.sparse_allreduce", "densified", "hvd.allreduce(t.to_dense())"),
    ],
    "syncbn": [("hvd.SyncBatchNorm", "nn.BatchNorm2d", "unsynced (nn.SyncBatchNorm: CUDA only)")],
}


@dataclass(kw_only=True)
class HorovodBenchConfig:
    """horovod: plait.horovod.torch's allreduce, Adasum, sparse allreduce and SyncBatchNorm.

    Each row times one facade call against its peer in the same world, in turns (a fresh
    order every repeat), as the slowest rank's seconds per call: hvd.allreduce and
    hvd.grouped_allreduce (--tensors tensors) against torch.distributed.all_reduce on gloo;
    op=hvd.Adasum against plait's own op=hvd.Average (Horovod, the only other Adasum, no
    longer builds); hvd.sparse_allreduce_async of an embedding's sparse gradient against
    gloo's sparse all_reduce and against the densified allreduce (sparse_as_dense=True);
    hvd.SyncBatchNorm's forward+backward against an unsynchronized nn.BatchNorm2d (the lower
    bound: torch.nn.SyncBatchNorm needs CUDA). No bar: the facade is measured, not judged,
    and the machine these runs share is too noisy for a fixed ratio to mean a regression.
    """

    ranks: int = field(default=2, metadata=option("ranks in the world", choices=RANKS))
    repeats: int = field(default=5, metadata=option("rounds of every measurement"))
    sizes: str = field(default="4K,4M", metadata=option("allreduce and Adasum message sizes"))
    tensors: int = field(default=10, metadata=option("tensors in a grouped allreduce"))
    table_rows: int = field(default=100_000, metadata=option("rows of the embedding table"))
    table_dim: int = field(default=64, metadata=option("columns of the embedding table"))
    touched: str = field(
        default="1,10", metadata=option("percent of the table's rows a rank's gradient touches")
    )
    batch: int = field(default=32, metadata=option("SyncBatchNorm: samples per rank"))
    channels: int = field(default=64, metadata=option("SyncBatchNorm: channels (8x8 images)"))
    budget: float = field(default=3.0, metadata=option("seconds of timed calls per case"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        if self.ranks not in RANKS:
            raise ConfigError(f"--ranks must be one of {RANKS}; got {self.ranks}")
        at_least_1(repeats=self.repeats, tensors=self.tensors, table_rows=self.table_rows,
                   table_dim=self.table_dim, batch=self.batch, channels=self.channels)  # fmt: skip
        sizes(self.sizes)
        percents(self.touched)
        if self.budget <= 0:
            raise ConfigError(f"--budget must be > 0 seconds; got {self.budget}")

    @property
    def size_list(self) -> list[int]:
        return sizes(self.sizes)

    @property
    def percent_list(self) -> list[float]:
        return percents(self.touched)


def percents(text: str) -> list[float]:
    """`text` as comma-separated percents in (0, 100]."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--touched must be comma-separated percents; got {text!r}") from None
    if any(not 0 < v <= 100 for v in values):
        raise ConfigError(f"--touched percents must be in (0, 100]; got {text!r}")
    return values

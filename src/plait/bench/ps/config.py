"""`plait bench ps`: its options, the configurations it runs and the bars. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, json_field, markdown_field, subset
from plait.errors import ConfigError
from plait.options import option
from plait.train.straggler import MODES as STRAGGLER_MODES
from plait.train.straggler import PERSISTENT, TRANSIENT

#: name -> the `plait train` options that make it; ratios are against BASELINE
CONFIGS: dict[str, list[str]] = {
    "allreduce": ["--strategy", "allreduce"],
    "ps sync": ["--strategy", "ps", "--ps-mode", "sync"],
    "ps ssp tau=1": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "1"],
    "ps ssp tau=4": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "4"],
    "ps async": ["--strategy", "ps", "--ps-mode", "async"],
    # P3/TicTac order on the servers' wire (docs/parameter-server.md#priority), 1 MiB slices
    "ps sync priority": ["--strategy", "ps", "--ps-mode", "sync", "--priority"],
}
BASELINE = "ps sync"
#: the issues' bars per straggler mode, (configuration, least throughput vs
#: BASELINE), each with the held-out metric at most 1 point worse than the baseline's
BARS: dict[str, tuple[tuple[str, float], ...]] = {
    PERSISTENT: (("ps async", 1.5), ("ps ssp tau=4", 1.5)),
    TRANSIENT: (("ps ssp tau=4", 1.3),),  # issue 15: what bounded staleness is for
}


@dataclass(kw_only=True)
class PsBenchConfig:
    """parameter server: sync vs ssp vs async vs allreduce, with a straggler.

    One run trains the same workload (a `plait train` job: same model, data, seed, steps
    and global batch) once per configuration and repeat: allreduce data parallelism
    (`plait.DataParallel`), and the parameter server in sync, ssp (tau 1 and 4) and async
    modes. With `--straggler F`, a worker is made F x slower (PLAIT_TRAIN_STRAGGLER): the
    last one at every step (`--straggler-mode persistent`), or one drawn per step from the
    seed and the step (`transient`). Sync and allreduce wait for it every step, ssp lets
    the others run at most tau steps ahead (and wait for a persistent straggler once they
    are), async never waits. Within a repeat the configurations run back to back in a
    fresh seeded order; the table shows medians over repeats and each one's throughput
    relative to ps sync (the median of per-repeat ratios).
    """

    model: str = field(default="mlp", metadata=option("the plait train model"))
    workers: int = field(default=4, metadata=option("workers W"))
    servers: int = field(default=2, metadata=option("parameter servers"))
    steps: int | None = field(
        default=None, metadata=option("global steps", default_text="the model's recipe")
    )
    batch_size: int | None = field(
        default=None, metadata=option("global batch", default_text="the model's recipe")
    )
    straggler: float = field(
        default=2.0, metadata=option("a worker is F x slower (1 for none)", metavar="F")
    )
    straggler_mode: str = field(
        default=PERSISTENT,
        metadata=option(
            "persistent: worker W-1 at every step; transient: a worker drawn per step",
            choices=STRAGGLER_MODES,
        ),
    )
    configs: str = field(
        default=",".join(CONFIGS),
        metadata=option(f"comma-separated subset of: {', '.join(CONFIGS)}", default_text="all"),
    )
    repeats: int = field(default=3, metadata=option("runs per configuration"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("configs", self.configs, list(CONFIGS))
        at_least_1(repeats=self.repeats)
        if self.workers < 1 or self.servers < 1:
            raise ConfigError(
                f"--workers and --servers must be >= 1; got {self.workers}, {self.servers}"
            )
        if self.straggler < 1.0:
            raise ConfigError(f"--straggler must be >= 1 (a slowdown factor); got {self.straggler}")
        if self.straggler_mode not in STRAGGLER_MODES:
            raise ConfigError(
                f"--straggler-mode must be one of {', '.join(STRAGGLER_MODES)}; "
                f"got {self.straggler_mode!r}"
            )

    @property
    def config_list(self) -> list[str]:
        return self.configs.split(",")

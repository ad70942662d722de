"""`plait bench comm`: its options and the ways it knows. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, batch_divides, json_field, markdown_field, subset
from plait.errors import ConfigError
from plait.options import option
from plait.train.recipes import MODELS

#: The ways it knows by name (plus topk:RATIO and powersgd:RANK); ratios are against fifo
WAYS = ("fifo", "priority", "fp16", "bf16", "ddp", "ddp-fp16", "ddp-powersgd")


@dataclass(kw_only=True)
class CommBenchConfig:
    """the communication wall: FIFO vs priority scheduling vs compression vs DDP, on slow links.

    Simulated hosts (network namespaces, needs root; --hosts 1: this machine's loopback)
    with each host's link limited to each of --link-rates in turn. Per rate and workload,
    every way trains the same model from one seed in turns (a fresh order per repeat), and
    the table gives the median samples/s, the ratio to plait FIFO (paired per repeat), and
    the bytes each rank sends per step. Ways: fifo (plait.DataParallel), priority
    (DataParallel(priority=True) with a scheduled optimizer), plait's compressions
    (fp16, bf16, topk:RATIO, powersgd:RANK), ddp, ddp-fp16 and ddp-powersgd (torch DDP
    with its fp16 and PowerSGD (rank 4) communication hooks). The FIFO row also shows
    the step's compute time (the same steps under no_sync): where communication is of the
    order of computation is where scheduling can gain.

    --to-target adds accuracy (bench/comm/target.py): each plait way trains the workload's
    recipe to its end with `plait train` on this machine (hosts x nproc workers, loopback:
    compression changes the arithmetic, not the link), same seed, at --global-batch, with
    held-out evaluation every --target-eval-every steps. The report gives each way's final
    held-out metric, its gap to fifo (uncompressed), and the first evaluated step at which
    it reached the target: fifo's final metric less 1 point of accuracy, or plus 0.05 nats
    of loss. Time to target = those steps x the way's median step time at each link rate
    of the timed part (skipped with --no-timing). torch DDP ways are not trained there.
    """

    workloads: str = field(
        default="wide,gpt", metadata=option(f"comma-separated subset of {','.join(MODELS)}")
    )
    ways: str = field(default=",".join(WAYS), metadata=option("comma-separated ways"))
    hosts: int = field(
        default=2, metadata=option("simulated hosts (network namespaces; 1: loopback)", metavar="H")
    )
    nproc: int = field(default=2, metadata=option("ranks per host", aliases=("-n",)))
    link_rates: str = field(
        default="100mbit,1gbit", metadata=option("each host's link rate, one run each (tc tbf)")
    )
    global_batch: int = field(default=64, metadata=option("global batch"))
    steps: int = field(default=4, metadata=option("timed steps per repeat"))
    repeats: int = field(default=3, metadata=option("repeats per cell"))
    warmup: int = field(default=3, metadata=option("untimed steps of each before timing"))
    slice_mb: float = field(default=1.0, metadata=option("priority's slice size in MiB"))
    credit_mb: float = field(
        default=2.0, metadata=option("priority's credit: MiB issued and not yet reduced")
    )
    to_target: bool = field(
        default=False, metadata=option("also train each way to the end: held-out metric, target")
    )
    target_steps: int | None = field(
        default=None, metadata=option("--to-target's steps", default_text="the model's recipe")
    )
    target_eval_every: int | None = field(
        default=None,
        metadata=option("--to-target: evaluate every K steps", metavar="K", default_text="1/20"),
    )
    no_timing: bool = field(default=False, metadata=option("with --to-target: skip the timing"))
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        subset("workloads", self.workloads, MODELS)
        if self.no_timing and not self.to_target:
            raise ConfigError("--no-timing leaves nothing to do without --to-target")
        if self.to_target and "fifo" not in self.way_list:
            raise ConfigError(f"--to-target needs fifo in --ways (its target is fifo's final "
                              f"metric); got --ways {self.ways}")  # fmt: skip
        for name, k in (("--target-steps", self.target_steps),
                        ("--target-eval-every", self.target_eval_every)):  # fmt: skip
            if k is not None and k < 1:
                raise ConfigError(f"{name} must be >= 1; got {k}")
        for way in self.way_list:
            if way not in WAYS and not way.startswith(("topk:", "powersgd:")):
                raise ConfigError(f"way {way!r} is not one of {', '.join(WAYS)}, "
                                  "topk:RATIO, powersgd:RANK")  # fmt: skip
        at_least_1(hosts=self.hosts, nproc=self.nproc, steps=self.steps, repeats=self.repeats)
        batch_divides(self.global_batch, [self.hosts * self.nproc])
        if not self.slice_mb > 0:
            raise ConfigError(f"--slice-mb must be > 0; got {self.slice_mb}")
        if not self.credit_mb > 0:
            raise ConfigError(f"--credit-mb must be > 0; got {self.credit_mb}")

    @property
    def way_list(self) -> list[str]:
        return self.ways.split(",")

    @property
    def workload_list(self) -> list[str]:
        return self.workloads.split(",")

    @property
    def rate_list(self) -> list[str | None]:
        return [r or None for r in self.link_rates.split(",")] if self.hosts > 1 else [None]

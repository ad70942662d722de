"""Every `plait bench` benchmark's options: one config dataclass each, checked on creation.

The command line is derived from these fields (plait/options.py); the parent process
(bench/jobs/) sends the whole config to its workers as JSON (bench/worker_io.py), so each
default is written once, here. A config's docstring is its `--help`: the first line is
the one-line help of `plait bench`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.units import ALGORITHMS, parse_size, parse_sizes
from plait.errors import ConfigError
from plait.options import option
from plait.pipeline.schedule import SCHEDULES
from plait.train.recipes import MODELS
from plait.train.straggler import MODES as STRAGGLER_MODES
from plait.train.straggler import PERSISTENT, TRANSIENT

SIZES = "4K,64K,1M,16M,64M"  # bytes per message, collectives and p2p alike
#: Where a benchmark's tensors are: cpu, or cuda (rank i on cuda:LOCAL_RANK, NCCL between)
DEVICES = ("cpu", "cuda")
# bench ps: name -> the `plait train` options that make it; ratios are against BASELINE
PS_CONFIGS: dict[str, list[str]] = {
    "allreduce": ["--strategy", "allreduce"],
    "ps sync": ["--strategy", "ps", "--ps-mode", "sync"],
    "ps ssp tau=1": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "1"],
    "ps ssp tau=4": ["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "4"],
    "ps async": ["--strategy", "ps", "--ps-mode", "async"],
    # P3/TicTac order on the servers' wire (docs/parameter-server.md#priority), 1 MiB slices
    "ps sync priority": ["--strategy", "ps", "--ps-mode", "sync", "--priority"],
}
PS_BASELINE = "ps sync"
# bench ps: the issues' bars per straggler mode, (configuration, least throughput vs
# PS_BASELINE), each with the held-out metric at most 1 point worse than the baseline's
PS_BARS: dict[str, tuple[tuple[str, float], ...]] = {
    PERSISTENT: (("ps async", 1.5), ("ps ssp tau=4", 1.5)),
    TRANSIENT: (("ps ssp tau=4", 1.3),),  # issue 15: what bounded staleness is for
}
# bench memory: what trains side by side: plait's DataParallel and ZeRO stages, then torch's
MEMORY_IMPLS = ("dp", "stage1", "stage2", "stage3", "ddp", "ddp-zero", "fsdp2")
#: A `plait bench memory` rank that ran out of memory under --limit exits with this status
MEMORY_EXIT_OOM = 3
# bench comm: the ways it knows by name (plus topk:RATIO and powersgd:RANK); ratios vs fifo
COMM_WAYS = ("fifo", "priority", "fp16", "bf16", "ddp", "ddp-fp16", "ddp-powersgd")


def _json() -> str | None:
    return field(
        default=None, metadata=option("also write the measurements as JSON", metavar="FILE")
    )


def _markdown() -> bool:
    return field(default=False, metadata=option("print a compact Markdown table (for READMEs)"))


def _device(what: str) -> str:
    return field(default="cpu", metadata=option(what, choices=DEVICES))


def _subset(name: str, text: str, known: tuple[str, ...] | list[str]) -> list[str]:
    """`text` split at commas, every item one of `known`."""
    items = text.split(",")
    unknown = [i for i in items if i not in known]
    if unknown:
        raise ConfigError(f"unknown {name} {unknown}; expected a subset of {', '.join(known)}")
    return items


def _device_known(device: str) -> None:
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {device!r}")


def _ints(name: str, text: str) -> list[int]:
    """`text` as comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--{name} must be comma-separated integers; got {text!r}") from None
    if any(v < 1 for v in values):
        raise ConfigError(f"--{name} values must be >= 1; got {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _batch_divides(global_batch: int, world_sizes: list[int]) -> None:
    for n in world_sizes:
        if global_batch % n:
            raise ConfigError(
                f"--global-batch {global_batch} % {n} ranks = {global_batch % n} != 0: "
                "every rank needs the same batch"
            )


def _limit(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"--limit: {e}") from None


def _at_least_1(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value}")


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
    device: str = _device("where each rank's tensors are: cpu, or cuda (its GPU; NCCL)")
    calibrate: bool = field(
        default=False,
        metadata=option(
            "first fit each algorithm's cost line for this world size and save it; "
            "algorithm='auto' uses it from then on"
        ),
    )
    json: str | None = _json()
    from_json: str | None = field(
        default=None,
        metadata=option(
            "measure nothing: print the tables of an earlier --json file", metavar="FILE"
        ),
    )
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n must be >= 1; got {self.nproc}")
        if self.hosts < 1:
            raise ConfigError(f"--hosts must be >= 1; got {self.hosts}")
        if self.link_rate and self.hosts == 1:
            raise ConfigError("--link-rate limits the links between hosts: add --hosts H (H >= 2)")
        _device_known(self.device)
        if self.device == "cuda" and self.hosts > 1:
            raise ConfigError(
                "--device cuda runs on this host's GPUs; --hosts simulates hosts with network "
                "namespaces, which share them: drop --hosts"
            )
        _at_least_1(repeats=self.repeats)
        _subset("algorithms", self.algorithms, ALGORITHMS)
        _sizes(self.sizes)

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
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        if self.nproc < 2 or self.nproc % 2:
            raise ConfigError(f"-n must be an even number >= 2 (ranks pair up); got {self.nproc}")
        _at_least_1(repeats=self.repeats)
        _sizes(self.sizes)

    @property
    def size_list(self) -> list[int]:
        """--sizes in bytes."""
        return parse_sizes(self.sizes)


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
    device: str = _device("where each rank trains: cpu, or cuda (its GPU; DDP over NCCL)")
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        _subset("workloads", self.workloads, MODELS)
        _device_known(self.device)
        _batch_divides(self.global_batch, _ints("nproc", self.nproc))
        _at_least_1(steps=self.steps, repeats=self.repeats)

    @property
    def world_sizes(self) -> list[int]:
        return _ints("nproc", self.nproc)

    @property
    def workload_list(self) -> list[str]:
        return self.workloads.split(",")


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
        default=",".join(PS_CONFIGS),
        metadata=option(f"comma-separated subset of: {', '.join(PS_CONFIGS)}", default_text="all"),
    )
    repeats: int = field(default=3, metadata=option("runs per configuration"))
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        _subset("configs", self.configs, list(PS_CONFIGS))
        _at_least_1(repeats=self.repeats)
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


@dataclass(kw_only=True)
class PipelineBenchConfig:
    """pipeline throughput and bubble: measured vs (p-1)/(M+p-1).

    Train a model of heavy Linear+Tanh layers with plait's Pipeline on p stages (one
    process each) for every schedule and micro-batch count M, and report samples/s, the
    measured bubble (median over steps of the mean over stages of each stage's idle
    fraction), the theory (p-1)/(M+p-1), their difference, and the speedup over one
    process running plain forward + backward of the same model and batch.
    """

    stages: str = field(default="2,4", metadata=option("pipeline sizes p"))
    chunks: str = field(default="1,2,4,8", metadata=option("micro-batch counts M"))
    schedules: str = field(
        default="gpipe,1f1b", metadata=option(f"comma-separated subset of {','.join(SCHEDULES)}")
    )
    layers: int = field(default=8, metadata=option("Linear+Tanh blocks"))
    width: int = field(default=512, metadata=option("layer width"))
    batch: int = field(default=512, metadata=option("samples per step"))
    repeats: int = field(default=5, metadata=option("timed steps per cell"))
    warmup: int = field(default=1, metadata=option("untimed steps per cell"))
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        stages, chunks = _ints("stages", self.stages), _ints("chunks", self.chunks)
        _subset("schedules", self.schedules, tuple(SCHEDULES))
        for p in stages:
            if p > self.layers:
                raise ConfigError(f"--stages {p} > --layers {self.layers}: a stage would be empty")
        for m in chunks:
            if m > self.batch:
                raise ConfigError(
                    f"--chunks {m} > --batch {self.batch}: a micro-batch would be empty"
                )
        _at_least_1(repeats=self.repeats, width=self.width)
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0; got {self.warmup}")

    @property
    def stage_list(self) -> list[int]:
        return _ints("stages", self.stages)

    @property
    def chunk_list(self) -> list[int]:
        return _ints("chunks", self.chunks)

    @property
    def schedule_list(self) -> list[str]:
        return self.schedules.split(",")


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
        default=",".join(MEMORY_IMPLS),
        metadata=option(f"comma-separated subset of {','.join(MEMORY_IMPLS)}", default_text="all"),
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
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        _subset("impls", self.impls, MEMORY_IMPLS)
        _batch_divides(self.global_batch, _ints("workers", self.workers))
        _at_least_1(
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
            _limit(self.limit)

    @property
    def world_sizes(self) -> list[int]:
        return _ints("workers", self.workers)

    @property
    def impl_list(self) -> list[str]:
        return self.impls.split(",")

    @property
    def limit_bytes(self) -> int | None:
        """--limit in bytes (K, M, G suffixes: powers of 1024); None without --limit."""
        return None if self.limit is None else _limit(self.limit)


#: `plait bench NAME` -> its config; NAME's parent side is the module plait.bench.jobs.NAME
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

    --to-target adds accuracy (bench/comm_target.py): each plait way trains the workload's
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
    ways: str = field(default=",".join(COMM_WAYS), metadata=option("comma-separated ways"))
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
    json: str | None = _json()
    markdown: bool = _markdown()

    def __post_init__(self) -> None:
        _subset("workloads", self.workloads, MODELS)
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
            if way not in COMM_WAYS and not way.startswith(("topk:", "powersgd:")):
                raise ConfigError(f"way {way!r} is not one of {', '.join(COMM_WAYS)}, "
                                  "topk:RATIO, powersgd:RANK")  # fmt: skip
        _at_least_1(hosts=self.hosts, nproc=self.nproc, steps=self.steps, repeats=self.repeats)
        _batch_divides(self.global_batch, [self.hosts * self.nproc])
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


BENCHMARKS: dict[str, type] = {
    "collectives": CollectivesConfig,
    "train": TrainBenchConfig,
    "ps": PsBenchConfig,
    "pipeline": PipelineBenchConfig,
    "p2p": P2PConfig,
    "memory": MemoryBenchConfig,
    "comm": CommBenchConfig,
}

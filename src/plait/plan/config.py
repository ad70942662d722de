"""`plait plan`'s options, as a dataclass (plait/options.py derives the command line).
No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.options import option
from plait.plan.plan import BUDGET, DEVICES, SEED, PlanRequest
from plait.sizes import parse_size
from plait.train.recipes import MODELS


@dataclass(kw_only=True)
class PlanConfig:
    """Which workload on which machine(s), and what to print."""

    model: str | None = field(
        default=None,
        metadata=option("the network", choices=MODELS, default_text="mlp, unless --workload"),
    )
    workload: str | None = field(
        default=None,
        metadata=option(
            "plan your own workload: a function returning a plait.train.Workload",
            metavar="MODULE:FUNCTION",
        ),
    )
    workers: int = field(default=4, metadata=option("ranks (all hosts together)"))
    hosts: int = field(
        default=1,
        metadata=option("hosts the workers are spread over, workers / hosts each", metavar="H"),
    )
    link_rate: str | None = field(
        default=None,
        metadata=option(
            "with --hosts: each host's network link, as tc writes it (100mbit, 1gbit)",
            metavar="RATE",
            default_text="1gbit",
        ),
    )
    memory_per_rank: str | None = field(
        default=None,
        metadata=option(
            "each rank's memory (e.g. 512M, 2G): plans that need more are infeasible",
            metavar="BYTES",
            default_text="no limit",
        ),
    )
    batch_size: int | None = field(
        default=None,
        metadata=option("the global batch", default_text="the model's recipe's"),
    )
    device: str = field(
        default="cpu",
        metadata=option(
            "where the ranks compute: cpu, or cuda (profile the model on this machine's GPU "
            "and cost the links as NCCL's; an error where there is no GPU)",
            choices=DEVICES,
        ),
    )
    top: int = field(default=10, metadata=option("print the K best plans", metavar="K"))
    json: str | None = field(
        default=None,
        metadata=option("write every plan predicted, ranked, to FILE as JSON", metavar="FILE"),
    )
    budget: int = field(
        default=BUDGET,
        metadata=option("Metropolis-Hastings proposals, where the space is too large to list"),
    )
    seed: int = field(default=SEED, metadata=option("the Metropolis-Hastings walk's seed"))
    per_layer: bool = field(
        default=False,
        metadata=option(
            "also search per-layer plans (each layer data-parallel, split or on one rank, "
            "as FlexFlow does) and print the best layer by layer, its gain over the best "
            "global plan, and which of the two plait train --plan best runs"
        ),
    )
    calibrate: bool = field(
        default=False,
        metadata=option(
            "fit this machine's overheads from a few short runs of the model (a minute or "
            "two for mlp) and cache them: later plans predict with them"
        ),
    )
    no_overheads: bool = field(
        default=False,
        metadata=option("predict from the profile alone, without the cached overheads"),
    )
    from_trace: str | None = field(
        default=None,
        metadata=option(
            "compare the prediction for a traced run (plait train --trace FILE) with what it "
            "measured, per category of events, and refit this machine's overheads to it",
            metavar="FILE",
        ),
    )
    warmup: int = field(
        default=2, metadata=option("with --from-trace: the first steps left out", metavar="N")
    )
    save: bool = field(
        default=False,
        metadata=option("with --from-trace: write the refitted overheads to this machine's cache"),
    )

    def __post_init__(self) -> None:
        if self.calibrate and self.hosts > 1:
            raise ConfigError(
                f"--calibrate with --hosts {self.hosts}: the calibration measures this machine, "
                "so it runs here, on one host; drop --hosts (the fitted overheads then serve "
                "plans of any --hosts)"
            )
        if self.calibrate and self.no_overheads:
            raise ConfigError(
                "--calibrate fits the overheads that --no-overheads leaves out: give one"
            )
        if self.top < 1:
            raise ConfigError(f"top {self.top} < 1")
        if self.budget < 1:
            raise ConfigError(f"budget {self.budget} < 1")
        if self.warmup < 0:
            raise ConfigError(f"warmup {self.warmup} < 0")
        if self.calibrate and self.from_trace is not None:
            raise ConfigError(
                "--calibrate runs its own plans; --from-trace refits to a run you traced: give one"
            )
        if self.per_layer and (self.calibrate or self.from_trace is not None):
            what = "--calibrate" if self.calibrate else "--from-trace"
            raise ConfigError(f"--per-layer plans a request; {what} does not: give one")
        if self.save and self.from_trace is None:
            raise ConfigError("--save writes what --from-trace refitted: give --from-trace FILE")
        if self.from_trace is None:  # (else the workers are the trace's)
            self.request()  # its own checks

    def memory_bytes(self) -> int | None:
        if self.memory_per_rank is None:
            return None
        try:
            return parse_size(self.memory_per_rank)
        except ValueError as e:
            raise ConfigError(f"memory_per_rank: {e}") from None

    def request(self) -> PlanRequest:
        """The search's request.

        Raises:
            ConfigError: workers or hosts below 1, workers not a multiple of hosts, a link
                rate without hosts or not as tc writes it, both --model and --workload.
        """
        if self.model is not None and self.workload is not None:
            raise ConfigError(
                f"--model {self.model} and --workload {self.workload}: give one (--workload "
                "brings its own model)"
            )
        model = self.model if self.workload is None else None
        return PlanRequest(
            model=model if model is not None or self.workload is not None else "mlp",
            workers=self.workers,
            hosts=self.hosts,
            link_rate=self.link_rate,
            memory_per_rank=self.memory_bytes(),
            batch_size=self.batch_size,
            workload=self.workload,
            device=self.device,
        )

    def beyond_this_machine(self) -> bool:
        """Whether the figures are of a cluster this machine is not (several hosts; local
        ranks beyond the cores run here, sharing them, and are modelled so)."""
        return self.hosts > 1

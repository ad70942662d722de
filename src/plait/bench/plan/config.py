"""`plait bench plan`: the planner's predictions checked against real runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from plait.bench.fields import at_least_1, json_field, size
from plait.errors import ConfigError
from plait.options import option
from plait.sizes import parse_rate
from plait.train.recipes import MODELS

#: The issues' bars (17, 35): the mean absolute error of the step time and of the largest
#: rank's memory, and how far the planner's top pick may be from the fastest plan measured
#: (all fractions)
MAX_STEP_ERROR = 0.10
MAX_MEMORY_ERROR = 0.10
MAX_TOP_PICK_GAP = 0.05
#: issue 36's bars on --per-layer: the per-layer plan at least this many times as fast as
#: the best global plan where one layer holds most of the parameters (GAIN_MODEL on
#: GAIN_HOSTS simulated hosts linked at GAIN_LINK), never slower than it by more than
#: MAX_LAYER_LOSS anywhere, and its step predicted within MAX_STEP_ERROR
MIN_LAYER_GAIN = 1.3
MAX_LAYER_LOSS = 0.05
GAIN_MODEL, GAIN_HOSTS, GAIN_LINK = "wide", 2, "100mbit"
#: --per-layer --matrix: issue 36's settings, each model on this machine, then on 2
#: simulated hosts at 100 Mbit/s: (model, hosts, link rate)
MATRIX = tuple(
    (model, hosts, link)
    for hosts, link in ((1, None), (GAIN_HOSTS, GAIN_LINK))
    for model in ("wide", "cnn", "gpt")
)


@dataclass(kw_only=True)
class PlanBenchConfig:
    """the planner checked against real runs: predicted vs measured step time and memory.

    Ask the planner (plait.plan.search, with this machine's fitted overheads where
    `plait plan --calibrate` cached them) for every plan of --model (or --workload) on
    --workers ranks, then train its --top plans and --sample others drawn at random
    (seeded) from the remaining feasible ones that were not calibration runs, with
    `plait train`, each --repeats times for --steps steps: on this machine, or with
    --hosts 2 on simulated hosts (network namespaces, needs root) joined by links limited
    to --link-rate. The measured step time is the median over repeats of each run's median
    step (the first --warmup steps left out); the measured memory of a rank is its model
    states counted from its tensors plus the activations autograd kept (--json's
    rank_memory, or memory with --zero), the figures the planner predicts. The table puts
    them side by side, with the Spearman rank correlation of predicted and measured step
    times and the overheads used (with their fit's residuals); then the bars, on the plans
    the overheads were not calibrated on: the mean absolute error of the step time <= 10%
    and of the memory <= 10%; the top pick within 5% of the fastest plan measured; and with
    --memory-per-rank no plan predicted to fit exceeding it (a CPU run has no memory cap:
    exceeding the limit counts as running out of memory).

    With --per-layer (issue 36), instead: ask the per-layer search
    (plait.plan.per_layer_search) for the setting and measure three plans the same way:
    the per-layer plan it found (its JSON given to `plait train --plan FILE`), the best
    global plan and plain data parallelism; report each one's predicted and measured step
    and memory per rank, the per-layer plan's measured speed-up over the other two, the
    layout it chose, and the bars: at least 1.3x the best global plan on wide with
    --hosts 2 --link-rate 100mbit, never more than 5% slower than it, predicted within 10%
    (--top and --sample are not used). --matrix runs the issue's six settings one after
    the other in one command: wide, cnn and gpt on this machine, then on 2 simulated hosts
    at 100mbit.
    """

    model: str | None = field(
        default=None,
        metadata=option("the model to plan", choices=MODELS, default_text="mlp, unless --workload"),
    )
    workload: str | None = field(
        default=None,
        metadata=option("plan and run your own workload (as plait train --workload)",
                        metavar="MODULE:FUNCTION"),
    )  # fmt: skip
    workers: int = field(default=4, metadata=option("ranks in all (over all hosts)"))
    hosts: int = field(
        default=1, metadata=option("simulated hosts (network namespaces; 1: this machine)")
    )
    link_rate: str | None = field(
        default=None,
        metadata=option("with --hosts > 1: each host's link rate (tc tbf), e.g. 100mbit",
                        metavar="RATE", default_text="unlimited"),
    )  # fmt: skip
    memory_per_rank: str | None = field(
        default=None,
        metadata=option("the memory limit per rank the planner plans for, e.g. 64M",
                        metavar="BYTES", default_text="none"),
    )  # fmt: skip
    batch_size: int | None = field(
        default=None, metadata=option("global batch", default_text="the model's recipe")
    )
    device: str = field(
        default="cpu",
        metadata=option(
            "where the ranks compute: cpu, or cuda (the planner profiles the GPU; every run "
            "gets --device cuda)",
            choices=("cpu", "cuda"),  # plait.plan.plan.DEVICES (the planner: imported late)
        ),
    )
    per_layer: bool = field(
        default=False,
        metadata=option("measure the per-layer plan against the best global plan and plain "
                        "data parallelism (issue 36)"),
    )  # fmt: skip
    matrix: bool = field(
        default=False,
        metadata=option("with --per-layer: every setting of issue 36 in turn (wide, cnn, gpt; "
                        "this machine, then 2 hosts at 100mbit), instead of --model, --hosts "
                        "and --link-rate"),
    )  # fmt: skip
    top: int = field(default=5, metadata=option("the planner's best plans to run"))
    sample: int = field(
        default=10, metadata=option("other feasible plans to run, drawn at random (seeded)")
    )
    steps: int = field(default=20, metadata=option("steps per run"))
    warmup: int = field(default=5, metadata=option("first steps of each run left untimed"))
    repeats: int = field(default=3, metadata=option("runs per plan (medians over them)"))
    seed: int = field(default=0, metadata=option("the sample's seed, and every run's --seed"))
    json: str | None = json_field()
    markdown: str | None = field(
        default=None, metadata=option("write the table and bars as Markdown", metavar="FILE")
    )

    def __post_init__(self) -> None:
        if self.model is not None and self.workload is not None:
            raise ConfigError(f"--model {self.model} and --workload {self.workload}: give one "
                              "(--workload brings its own model)")  # fmt: skip
        at_least_1(workers=self.workers, hosts=self.hosts, top=self.top, steps=self.steps,
                   repeats=self.repeats)  # fmt: skip
        if self.sample < 0:
            raise ConfigError(f"--sample must be >= 0; got {self.sample}")
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"--warmup {self.warmup} must be >= 0 and < --steps {self.steps}: at least "
                "one step is timed"
            )
        if self.workers % self.hosts:
            raise ConfigError(
                f"--workers {self.workers} % --hosts {self.hosts} = "
                f"{self.workers % self.hosts} != 0: every host runs the same number of ranks"
            )
        if self.matrix and not self.per_layer:
            raise ConfigError("--matrix is --per-layer's: give both")
        if self.matrix and (self.workload or self.model or self.hosts > 1 or self.link_rate):
            raise ConfigError("--matrix sets --model, --hosts and --link-rate itself (issue "
                              "36's settings): leave them out, or leave out --matrix")  # fmt: skip
        if self.matrix and self.workers % GAIN_HOSTS:
            raise ConfigError(f"--matrix runs on {GAIN_HOSTS} hosts too: --workers "
                              f"{self.workers} % {GAIN_HOSTS} = {self.workers % GAIN_HOSTS} "
                              "!= 0")  # fmt: skip
        if self.link_rate is not None and self.hosts < 2:
            raise ConfigError(f"--link-rate {self.link_rate} needs --hosts >= 2 (a link "
                              "between hosts); got --hosts 1")  # fmt: skip
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1; got {self.batch_size}")
        if self.link_rate is not None:  # checked now, not after the runs
            try:
                parse_rate(self.link_rate)
            except ValueError as e:
                raise ConfigError(f"--link-rate: {e}") from None
        self.memory_bytes  # noqa: B018

    def fixed(self) -> dict[str, Any]:
        """The `plait train` options every run shares (PlanRequest.train_options()'s)."""
        what: dict[str, Any] = (
            {"workload": self.workload} if self.workload else {"model": self.model or "mlp"}
        )
        if self.batch_size is not None:
            what["batch_size"] = self.batch_size
        if self.device != "cpu":
            what["device"] = self.device
        return what

    def settings(self) -> list[PlanBenchConfig]:
        """With --matrix, one config per setting of MATRIX (else this one alone)."""
        if not self.matrix:
            return [self]
        return [replace(self, matrix=False, model=m, hosts=h, link_rate=link)
                for m, h, link in MATRIX]  # fmt: skip

    @property
    def memory_bytes(self) -> int | None:
        """--memory-per-rank in bytes (K, M, G: powers of 1024; None: no limit)."""
        if self.memory_per_rank is None:
            return None
        return size("--memory-per-rank", self.memory_per_rank)

    def request(self) -> Any:
        """The planner's PlanRequest for this config (plait.plan: imported now, not before,
        so that the command line parses without the planner).

        Raises:
            ImportError: the planner cannot be imported.
        """
        from plait import plan as planner

        fixed = self.fixed()
        cores = max(1, (os.cpu_count() or 1) // self.hosts)
        return planner.PlanRequest(
            model=fixed.get("model"), workers=self.workers, hosts=self.hosts,
            link_rate=self.link_rate, memory_per_rank=self.memory_bytes,
            # the simulated hosts are namespaces of this machine: they share its cores
            cores_per_host=cores if self.hosts > 1 else None,
            batch_size=self.batch_size, workload=self.workload, device=self.device,
        )  # fmt: skip

    @property
    def where(self) -> str:
        """Where the runs ran, in words: "4 ranks on 2 simulated hosts, link 100mbit"."""
        return f"{self.workers} ranks" + (
            f" on {self.hosts} simulated hosts, link {self.link_rate or 'unlimited'}"
            if self.hosts > 1 else " on this machine")  # fmt: skip

    @property
    def nproc(self) -> int:
        """Ranks per host."""
        return self.workers // self.hosts

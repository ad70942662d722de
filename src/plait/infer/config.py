"""`plait infer`'s options, as a dataclass (plait/options.py derives the command line).

No torch here: the command line checks its options before it starts any worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from plait import env
from plait.errors import ConfigError
from plait.options import flag, option

QUANTIZE = ("none", "int8")
DEVICES = env.REGISTRY["PLAIT_DEVICE"].choices  # auto, cpu, cuda: one table (env.py)
PRECISIONS = ("fp32", "bf16")
SPLITS = ("val", "train")  # --data naming one of the run's own splits


@dataclass(kw_only=True)
class InferConfig:
    """Which trained run, on which inputs, how, and where the predictions go."""

    source: str | None = field(
        default=None,
        metadata=option(
            "the run to apply: the directory `plait train --out` wrote (plain or sharded)",
            metavar="DIR",
            name="from",
        ),
    )
    data: str = field(
        default="val",
        metadata=option(
            "the inputs: val (the held-out samples of the run's own data, labels included; "
            "its data's name, e.g. digits, means the same), train (its training samples), a "
            ".pt file (a tensor of inputs, or a dict with 'inputs' and optional 'targets'), "
            "or for a language model any other file, read as bytes in windows of its context",
            metavar="DATA",
        ),
    )
    out: str | None = field(
        default=None,
        metadata=option(
            "write the predictions here, one JSON line per input, in input order",
            metavar="FILE",
        ),
    )
    workers: int = field(
        default=1, metadata=option("processes (the inputs are sharded over workers / (pp*tp))")
    )
    batch_size: int = field(default=256, metadata=option("inputs per forward pass"))
    limit: int | None = field(
        default=None,
        metadata=option("predict the first N inputs only", metavar="N", default_text="all"),
    )
    pp: int = field(
        default=1, metadata=option("pipeline stages each forward runs through (forward only)")
    )
    tp: int = field(default=1, metadata=option("tensor-parallel ranks (gpt's heads and MLP)"))
    chunks: int | None = field(
        default=None,
        metadata=option(
            "micro-batches per batch through the pipeline", metavar="M", default_text="pp"
        ),
    )
    quantize: str = field(
        default="none",
        metadata=option(
            "int8: dynamic int8 quantization of the linear layers (weights int8, "
            "activations quantized per batch)",
            choices=QUANTIZE,
        ),
    )
    precision: str = field(
        default="fp32",
        metadata=option("bf16: weights and activations in bfloat16", choices=PRECISIONS),
    )
    device: str = field(
        default="auto",
        metadata=option(
            "where each worker predicts: cuda (GPU LOCAL_RANK of the host), cpu, or auto "
            "(cuda where torch sees a GPU; the CPU for --quantize int8)",
            choices=DEVICES,
        ),
    )
    threads: int | None = field(
        default=None,
        metadata=option("torch threads per worker", default_text="this machine's cores / workers"),
    )
    retry: int = field(
        default=0,
        metadata=option(
            "run a shard whose worker died again, up to N times (0: fail, keeping what "
            "was written)",
            metavar="N",
        ),
    )
    json: str | None = field(
        default=None, metadata=option("write the summary figures to FILE", metavar="FILE")
    )

    def __post_init__(self) -> None:
        if self.source is None:
            raise ConfigError("--from DIR is required: the directory `plait train --out` wrote")
        if self.out is None:
            raise ConfigError("--out FILE is required: where the predictions go (JSON lines)")
        for name in ("workers", "batch_size", "pp", "tp", "chunks", "limit", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} {value} < 1")
        if self.retry < 0:
            raise ConfigError(f"--retry {self.retry} < 0")
        per_group = self.pp * self.tp
        if self.workers % per_group:
            raise ConfigError(
                f"--workers {self.workers} % (pp {self.pp} * tp {self.tp}) = "
                f"{self.workers % per_group} != 0: each shard of the inputs runs on pp * tp "
                f"workers; try --workers {per_group * max(1, self.workers // per_group)}"
            )
        if self.chunks is None:
            self.chunks = self.pp
        if self.quantize == "int8" and self.tp > 1:
            raise ConfigError(
                "--quantize int8 with --tp: the int8 layers are not tensor-parallel ones; "
                "quantize with --pp or data-parallel workers, or leave --tp 1"
            )
        if self.quantize == "int8" and self.device == "cuda":
            raise ConfigError(
                "--quantize int8 with --device cuda: torch's dynamic int8 layers run on the "
                "CPU only; use --device cpu (or auto), or --precision bf16 on the GPU"
            )
        if self.quantize == "int8" and self.precision != "fp32":
            raise ConfigError(
                f"--quantize int8 with --precision {self.precision}: int8 layers take fp32 "
                "activations; choose one"
            )

    @property
    def device_name(self) -> str:
        """The device every worker asks for (int8 runs on the CPU, whatever auto finds)."""
        return "cpu" if self.quantize == "int8" else self.device

    @property
    def groups(self) -> int:
        """The shards the inputs are cut into: one per pp x tp group of workers."""
        return self.workers // (self.pp * self.tp)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

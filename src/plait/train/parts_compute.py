"""`plait train --precision/--reduce-dtype/--compression/--activation-checkpointing/--compile`:
how each rank computes (and sends its gradients), as one config component, and the lines it
adds to the run's header and summary.

`--reduce-dtype bf16` is `--compression bf16` by its older name (one mechanism:
DataParallel's fp16/bf16 compressor); `wire` is the compression a run uses either way.

A component of TrainConfig, named as the others are (parts.py, parts_io.py, parts_ps.py):
what the options do lives beside the Steps (steps/compute.py, on top of precision.py,
compile.py and plait.checkpoint_blocks); which strategies take which values is a column of
strategies.py. This module imports no torch: the command line and the summary read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from plait.data_parallel import spec
from plait.options import flag, option
from plait.train.errors import ConfigError

# --precision and --reduce-dtype names -> torch dtype names (precision.py makes the dtypes)
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LOSS_SCALE = 2.0**16  # fp16's first loss scale: torch.amp.GradScaler's default init_scale


@dataclass(kw_only=True)
class ComputeConfig:
    """How every rank computes: precision, activation checkpointing, compilation."""

    precision: str = field(
        default="fp32",
        metadata=option(
            "compute forward and loss in this precision (torch.autocast); parameters, "
            "gradients and optimizer state stay fp32; fp16 adds dynamic loss scaling",
            choices=tuple(PRECISIONS),
        ),
    )
    reduce_dtype: str = field(
        default="fp32",
        metadata=option(
            "average gradients across data-parallel ranks in this dtype (bf16 and fp16 "
            "halve the bytes on the wire)",
            choices=tuple(PRECISIONS),
        ),
    )
    compression: str = field(
        default="none",
        metadata=option(
            f"how data-parallel ranks send their gradients: {spec.forms()} (top-k and "
            "PowerSGD with error feedback; fp16/bf16 are --reduce-dtype's)",
            metavar="METHOD",
        ),
    )
    loss_scale: float = field(
        default=LOSS_SCALE,
        metadata=option(
            "with --precision fp16: the first loss scale (halved on every overflow, whose "
            "step is skipped; doubled after 2000 steps without one)",
            metavar="S",
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=option(
            "keep only each repeated block's input from forward to backward and run the "
            "block again in backward (plait.checkpoint_blocks): less memory, more time"
        ),
    )
    compile: bool = field(
        default=False,
        metadata=option(
            "torch.compile the model (each pipeline stage with --pp); the compilation is "
            "timed apart from the steps (needs a C++ compiler on the CPU)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("precision", "reduce_dtype"):
            value = getattr(self, name)
            if value not in PRECISIONS:
                raise ConfigError(f"{flag(name)} {value!r} is not one of {', '.join(PRECISIONS)}")
        spec.parse(self.compression)  # the message says what was expected and given
        if self.reduce_dtype != "fp32" and self.compression not in ("none", self.reduce_dtype):
            raise ConfigError(
                f"--reduce-dtype {self.reduce_dtype} and --compression {self.compression} both "
                f"say how gradients cross the wire (--reduce-dtype {self.reduce_dtype} is "
                f"--compression {self.reduce_dtype}): give one"
            )
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ConfigError(f"--loss-scale {self.loss_scale:g} is not a finite number > 0")
        if self.loss_scale != LOSS_SCALE and self.precision != "fp16":
            raise ConfigError(
                f"--loss-scale {self.loss_scale:g} applies to --precision fp16 only, not "
                f"--precision {self.precision}: bf16 has fp32's range and needs no scaling"
            )

    @property
    def wire(self) -> str:
        """The compression data parallelism uses: --compression, or --reduce-dtype's."""
        if self.compression == "none" and self.reduce_dtype != "fp32":
            return self.reduce_dtype
        return self.compression

    @property
    def plain(self) -> bool:
        """Whether every option is at its default: the eager fp32 arithmetic of before."""
        return self == ComputeConfig()

    def check(self, *, tp: int, zero: int) -> None:
        """What a run with --tp `tp` and --zero `zero` takes of these options (what its
        strategy takes: strategies.py's `Strategy.check_compute`).

        Raises:
            ConfigError: naming the options that do not run together.
        """
        why = spec.METHODS[spec.parse(self.wire).method].not_sharded
        if zero and why:
            raise ConfigError(
                f"{self.wire_option()} does not run with --zero {zero}: {why}; use "
                "--compression fp16 or bf16 with --zero"
            )
        if self.compile and tp > 1:
            raise ConfigError(
                f"--compile with --tp {tp} is not supported: torch.compile cannot trace "
                "the tensor-parallel layers' collectives; use --compile with --dp/--pp only"
            )

    def wire_option(self) -> str:
        """The option that set `wire`, as the user wrote it."""
        if self.compression == "none":
            return f"--reduce-dtype {self.reduce_dtype}"
        return f"--compression {self.compression}"


def describe(config: ComputeConfig) -> str | None:
    """The run header's "compute:" line; None when everything is at its default."""
    if config.plain:
        return None
    parts = [f"{config.precision} autocast" if config.precision != "fp32" else "fp32"]
    if config.wire in PRECISIONS:
        parts.append(f"gradients averaged in {config.wire}")
    elif config.wire != "none":
        parts.append(f"gradients sent as {config.wire}")
    if config.activation_checkpointing:
        parts.append("activation checkpointing")
    if config.compile:
        parts.append("torch.compile")
    return ", ".join(parts)


def rows(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's rows of these options' figures (steps/compute.py's `figures`)."""
    found: list[tuple[str, str]] = []
    if rec.get("precision", "fp32") != "fp32" or rec.get("reduce_dtype", "fp32") != "fp32":
        text = f"{rec['precision']} compute"
        if rec["reduce_dtype"] != "fp32":
            text += f", gradients averaged in {rec['reduce_dtype']}"
        if rec.get("loss_scale") is not None:
            text += (f"; loss scale {rec['loss_scale']:g} at the end, "
                     f"{rec['skipped_steps']} steps skipped on overflow")  # fmt: skip
        found.append(("precision", text))
    if rec.get("compression", "none") != "none" and rec.get("sent_bytes") is not None:
        who = "the busiest rank" if "sent_bytes_by_rank" in rec else "each rank"  # a mesh's
        found.append(("compression", f"{rec['compression']}: {size(rec['sent_bytes'])} sent "
                      f"per step by {who} into the gradient collectives"))  # fmt: skip
    blocks = rec.get("checkpointed_blocks")
    if blocks:
        found.append(("checkpointed", f"{len(blocks)} blocks ({blocks[0]} to {blocks[-1]})"))
    if rec.get("activation_bytes") is not None:
        found.append(("activations", f"{size(rec['activation_bytes'])} kept from forward to "
                      "backward (rank 0's first slice)"))  # fmt: skip
    if rec.get("peak_saved_bytes") and rec.get("compile_s") is None:  # (compiled: not seen)
        sizes = ", ".join(size(b) for b in rec["peak_saved_bytes"])
        found.append(("activations", f"{sizes} kept for backward at the peak, per stage"))
    if rec.get("compile_s") is not None:
        found.append(("compile", f"{rec['compile_s']:.1f} s (the first forward and "
                      "backward, off the training clock)"))  # fmt: skip
    return found


def size(nbytes: int) -> str:
    """Bytes as people read them: "34.1 MiB", "16.0 KiB"."""
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"

"""What the benchmarks' configs share: their common fields and the checks of their values."""

from __future__ import annotations

from dataclasses import field

from plait.errors import ConfigError
from plait.options import option
from plait.sizes import parse_size, parse_sizes

SIZES = "4K,64K,1M,16M,64M"  # bytes per message, collectives and p2p alike
#: Where a benchmark's tensors are: cpu, or cuda (rank i on cuda:LOCAL_RANK, NCCL between)
DEVICES = ("cpu", "cuda")


def json_field() -> str | None:
    return field(
        default=None, metadata=option("also write the measurements as JSON", metavar="FILE")
    )


def markdown_field() -> bool:
    return field(default=False, metadata=option("print a compact Markdown table (for READMEs)"))


def device_field(what: str) -> str:
    return field(default="cpu", metadata=option(what, choices=DEVICES))


def subset(name: str, text: str, known: tuple[str, ...] | list[str]) -> list[str]:
    """`text` split at commas, every item one of `known`."""
    items = text.split(",")
    unknown = [i for i in items if i not in known]
    if unknown:
        raise ConfigError(f"unknown {name} {unknown}; expected a subset of {', '.join(known)}")
    return items


def device_known(device: str) -> None:
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {device!r}")


def ints(name: str, text: str) -> list[int]:
    """`text` as comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--{name} must be comma-separated integers; got {text!r}") from None
    if any(v < 1 for v in values):
        raise ConfigError(f"--{name} values must be >= 1; got {text!r}")
    return values


def sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def batch_divides(global_batch: int, world_sizes: list[int]) -> None:
    for n in world_sizes:
        if global_batch % n:
            raise ConfigError(
                f"--global-batch {global_batch} % {n} ranks = {global_batch % n} != 0: "
                "every rank needs the same batch"
            )


def size(flag: str, text: str) -> int:
    """`text` in bytes (4K, 64M: powers of 1024); a ConfigError naming `flag` if it is not one."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None


def at_least_1(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value}")

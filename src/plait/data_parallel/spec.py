"""The written form of a gradient compression: `none`, `fp16`, `bf16`, `topk:RATIO`,
`powersgd:RANK`; parsed and checked without torch.

`plait train --compression` checks its value here before any worker starts (the command
line loads no torch), and `DataParallel(compression="topk:0.01")` builds its compressor
from the same parse (compression.py): the grammar and its messages live in this one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.errors import ConfigError


@dataclass(frozen=True)
class Method:
    """One compression method as written: its name, and its one parameter if it takes one."""

    help: str  # what it does, for --help and the docs
    parameter: str = ""  # the parameter's placeholder ("RATIO"), "" for none
    expects: str = ""  # the values the parameter takes, with an example
    kind: type[int] | type[float] = float  # the parameter's type
    valid: Callable[[float], bool] = lambda value: True  # its range
    not_sharded: str = ""  # why ZeRO's reduce-scatter cannot carry it ("": it can)


METHODS: dict[str, Method] = {
    "none": Method("plain allreduce in the gradients' dtype"),
    "fp16": Method("allreduce in float16, each gradient divided by the world size first"),
    "bf16": Method("allreduce in bfloat16, each gradient divided by the world size first"),
    "topk": Method(
        "each rank sends its RATIO largest-magnitude entries per bucket (error feedback)",
        "RATIO",
        "0 < RATIO <= 1 (the share of each bucket's entries a rank sends), e.g. topk:0.01",
        kind=float,
        valid=lambda ratio: 0 < ratio <= 1,
        not_sharded="each rank sends other indices, so the sum is no reduce-scatter of equal parts",
    ),
    "powersgd": Method(
        "PowerSGD: a rank-RANK approximation P Q^T of each gradient matrix (error feedback)",
        "RANK",
        "RANK an integer >= 1 (the rank of the approximation), e.g. powersgd:4",
        kind=int,
        valid=lambda rank: rank >= 1,
        not_sharded="its factors are allreduced whole and every rank rebuilds the whole "
        "gradient, which a shard never holds",
    ),
}


def forms() -> str:
    """Every accepted form: "none, fp16, bf16, topk:RATIO or powersgd:RANK"."""
    *first, last = [f"{n}:{m.parameter}" if m.parameter else n for n, m in METHODS.items()]
    return f"{', '.join(first)} or {last}"


@dataclass(frozen=True)
class Spec:
    """A parsed compression: `method` (a key of METHODS) and its parameter (None if none)."""

    method: str
    value: float | int | None = None

    def __str__(self) -> str:
        return self.method if self.value is None else f"{self.method}:{self.value:g}"


def parse(text: str) -> Spec:
    """The Spec of `text`, e.g. "topk:0.01" -> Spec("topk", 0.01).

    Raises:
        ConfigError: `text` is no accepted form; the message says what was expected and
            what was given.
    """
    if not isinstance(text, str):
        raise ConfigError(f"compression {text!r}: expected a string, {forms()}; got a "
                          f"{type(text).__name__}")  # fmt: skip
    name, colon, arg = text.partition(":")
    method = METHODS.get(name)
    if method is None:
        raise ConfigError(f"compression {text!r}: expected {forms()}; got method {name!r}")
    if not method.parameter:
        if colon:
            raise ConfigError(f"compression {text!r}: {name} takes no parameter; expected "
                              f"{name!r}, got parameter {arg!r}")  # fmt: skip
        return Spec(name)
    head = f"compression {text!r}: expected {name}:{method.parameter} with {method.expects}"
    if not arg:
        raise ConfigError(f"{head}; got no {method.parameter}")
    try:
        value = method.kind(arg)
    except ValueError:
        raise ConfigError(f"{head}; got {method.parameter} {arg!r}") from None
    if not method.valid(value):
        raise ConfigError(f"{head}; got {method.parameter} {arg}")
    return Spec(name, value)

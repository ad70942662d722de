"""Command-line options derived from a config dataclass: one source for every option.

Each field of a `@dataclass` becomes `--field-name`, with its type, its choices and its help
taken from the field (`option(...)` metadata), and its default shown from the dataclass. The
parser's defaults are suppressed, so only the options the user gave reach the dataclass,
whose own defaults (and `__post_init__` checks) then apply. Nothing here is specific to
training; any component config can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_SCALARS = (int, float, str, bool)


def option(
    help: str,
    *,
    choices: Sequence[Any] = (),
    metavar: str | None = None,
    default_text: str | None = None,
    cli: bool = True,
) -> dict[str, Any]:
    """Field metadata for `add_options`.

    Args:
        help: one line for --help.
        choices: the accepted values (argparse rejects others, listing these).
        metavar: the placeholder in --help, e.g. "DIR".
        default_text: how --help states the default when the field's own default (often
            None, "decided later") does not say it.
        cli: False keeps the field off the command line.
    """
    return {
        "help": help,
        "choices": tuple(choices),
        "metavar": metavar,
        "default_text": default_text,
        "cli": cli,
    }


def flag(name: str) -> str:
    """The command-line flag of field `name`: `batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def scalar_type(annotation: Any) -> type:
    """The scalar type of a field annotation: `int | None` -> int."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot derive an option from the union {annotation}")
        annotation = args[0]
    if annotation not in _SCALARS:
        raise TypeError(f"cannot derive an option from type {annotation!r}")
    return typing.cast(type, annotation)


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of dataclass `cls` to `parser`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        kind = scalar_type(hints[f.name])
        default = _default(f)
        shown = meta.get("default_text") or (None if default is None else str(default))
        text = meta.get("help", "")
        if shown is not None and kind is not bool:
            text = f"{text} (default: {shown})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs["type"] = kind
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            kwargs["metavar"] = meta.get("metavar") or (
                "{" + ",".join(map(str, meta["choices"])) + "}"
                if meta.get("choices")
                else kind.__name__.upper()
            )
        parser.add_argument(flag(f.name), **kwargs)


def given(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` the user set on the command line, by field name."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}


def from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """Build `cls` from the options given; the dataclass supplies the rest."""
    return cls(**given(namespace, cls))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None

"""Command-line options derived from a config dataclass: one source for every option.

Each field of a `@dataclass` becomes `--field-name`, with its type, its choices and its help
taken from the field (`option(...)` metadata), and its default shown from the dataclass. The
parser's defaults are suppressed, so only the options the user gave reach the dataclass,
whose own defaults (and `__post_init__` checks) then apply. A field that holds a component
config (`group(...)` metadata, another dataclass) adds that component's options under their
own names: one flat command line over a config made of parts (`build`, `flatten`).
`plait train`, `plait run` and every `plait bench` derive their options here. This module
imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
    metavar: str | tuple[str, ...] | None = None,
    default_text: str | None = None,
    cli: bool = True,
    aliases: Sequence[str] = (),
    name: str | None = None,
) -> dict[str, Any]:
    """Field metadata for `add_options`.

    Args:
        help: one line for --help.
        choices: the accepted values (argparse rejects others, listing these).
        metavar: the placeholder in --help, e.g. "DIR" (one per value of a tuple field).
        default_text: how --help states the default when the field's own default (often
            None, "decided later") does not say it.
        cli: False keeps the field off the command line.
        aliases: more flags for the same option, e.g. ("-n",) beside `--nproc`.
        name: the option's name when it is not the field's: PSConfig's `mode` is `ps_mode`
            on `plait train`'s command line (`--ps-mode`); `given` and `build` use it too.
    """
    return {
        "help": help,
        "choices": tuple(choices),
        "metavar": metavar,
        "default_text": default_text,
        "cli": cli,
        "aliases": tuple(aliases),
        "name": name,
    }


def group(title: str, *, only: Sequence[str] | None = None) -> dict[str, Any]:
    """Field metadata for a field that holds a component config (itself a dataclass).

    The component's options join the command line of the dataclass that holds it, under
    `title` in --help; `build` makes the component from them, `flatten` reads them back.
    A component field whose default is None is made only when one of its options is given.

    Args:
        only: the component's fields that are options here (default: every field that is
            not `cli=False`), for a component that has settings no command line sets.
    """
    return {"group": title, "only": None if only is None else tuple(only)}


def flag(name: str) -> str:
    """The command-line flag of field `name`: `batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def scalar_type(annotation: Any) -> type:
    """The scalar type of a field annotation: `int | None` -> int; `tuple[int, int]` -> int
    (an option that takes several values, `_count`)."""
    annotation = _unoptional(annotation)
    if typing.get_origin(annotation) is tuple and len(set(typing.get_args(annotation))) == 1:
        annotation = typing.get_args(annotation)[0]
    if annotation not in _SCALARS:
        raise TypeError(f"cannot derive an option from type {annotation!r}")
    return typing.cast(type, annotation)


def _unoptional(annotation: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"cannot derive an option from the union {annotation}")
        return args[0]
    return annotation


def _count(annotation: Any) -> int | None:
    """How many values the option of a `tuple[T, ...]` field takes (argparse's nargs);
    None for a scalar."""
    annotation = _unoptional(annotation)
    return len(typing.get_args(annotation)) if typing.get_origin(annotation) is tuple else None


@dataclasses.dataclass(frozen=True)
class _Option:
    """One command-line option: a scalar field of the dataclass or of one of its components."""

    name: str  # the option's name (argparse's dest): the field's, or option(name=...)
    field: dataclasses.Field[Any]
    kind: type  # int, float, str or bool
    title: str | None  # the --help group of its component; None: the dataclass's own
    nargs: int | None = None  # a tuple field's option takes this many values


def component(annotation: Any) -> type | None:
    """The dataclass a field annotation holds (`PSConfig | None` -> PSConfig), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return (
        annotation
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation)
        else None
    )


@functools.cache
def _fields(
    cls: type, only: Sequence[str] | None
) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """The fields of `cls` that are options or components, with their resolved annotations.

    Once per class: resolving the annotations takes ~1 ms for TrainConfig's parts, and the
    planner (plait.plan) checks thousands of configs."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f, hints[f.name])
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli", True) and (only is None or f.name in only)
    )


def _name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("name") or f.name)


def _options(
    cls: type, title: str | None = None, only: Sequence[str] | None = None
) -> list[_Option]:
    """Every option of `cls` and of its components, in field order."""
    found: list[_Option] = []
    for f, hint in _fields(cls, only):
        sub = component(hint)
        if sub is not None:
            found += _options(sub, f.metadata.get("group", title), f.metadata.get("only"))
        else:
            found.append(_Option(_name(f), f, scalar_type(hint), title, _count(hint)))
    names = [o.name for o in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: options {twice} are declared twice")
    return found


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of dataclass `cls` (and of its components) to `parser`."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in _options(cls):
        meta = o.field.metadata
        kind = o.kind
        default = _default(o.field)
        shown = meta.get("default_text") or (None if default is None else str(default))
        text = meta.get("help", "")
        if shown is not None and kind is not bool:
            text = f"{text} (default: {shown})"
        kwargs: dict[str, Any] = {"dest": o.name, "default": argparse.SUPPRESS, "help": text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs["type"] = kind
            if o.nargs is not None:
                kwargs["nargs"] = o.nargs  # argparse gives a list; the dataclass makes it a tuple
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            kwargs["metavar"] = meta.get("metavar") or (
                "{" + ",".join(map(str, meta["choices"])) + "}"
                if meta.get("choices")
                else kind.__name__.upper()
            )
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if o.title is not None:
            if o.title not in groups:
                groups[o.title] = parser.add_argument_group(o.title)
            target = groups[o.title]
        target.add_argument(*meta.get("aliases", ()), flag(o.name), **kwargs)


def given(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of `cls` (and its components) the user set on the command line, by name."""
    names = {o.name for o in _options(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}


def from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """Build `cls` from the options given; the dataclass supplies the rest."""
    return build(cls, given(namespace, cls))


def build(cls: type[T], options: dict[str, Any]) -> T:
    """`cls` made from options by name (as `given` returns them), its components from theirs.

    A component that defines `from_command_line(**fields)` (a classmethod) is made by it: for
    an option that sets two of its fields.

    Raises:
        TypeError: a name that is no option of `cls` or of its components.
    """
    left = dict(options)
    made = _make(cls, left, optional=False, only=None)
    if left:
        raise TypeError(f"{cls.__name__} has no option {', '.join(sorted(left))}")
    return typing.cast(T, made)


def _make(cls: type, left: dict[str, Any], optional: bool, only: Sequence[str] | None) -> Any:
    kwargs: dict[str, Any] = {}
    for f, hint in _fields(cls, only):
        sub = component(hint)
        if sub is not None:
            part = _make(sub, left, optional=f.default is None, only=f.metadata.get("only"))
            if part is not None:
                kwargs[f.name] = part
        elif _name(f) in left:
            kwargs[f.name] = left.pop(_name(f))
    if optional and not kwargs:
        return None
    return getattr(cls, "from_command_line", cls)(**kwargs)


def flatten(obj: Any, only: Sequence[str] | None = None) -> dict[str, Any]:
    """The option values of dataclass instance `obj` and its components, by option name."""
    values: dict[str, Any] = {}
    cls: type = type(obj)
    for f, hint in _fields(cls, only):
        value = getattr(obj, f.name)
        if component(hint) is None:
            values[_name(f)] = value
        elif value is not None:
            values.update(flatten(value, f.metadata.get("only")))
    return values


def load(cls: type[T], values: dict[str, Any]) -> T:
    """`cls` from `dataclasses.asdict` output (say, read back from JSON), components included."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        sub = component(hints.get(name))
        kwargs[name] = load(sub, value) if sub is not None and isinstance(value, dict) else value
    return cls(**kwargs)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None

"""The one renderer of every benchmark's report: its tables and lines, on the console or as
Markdown.

A benchmark's `report` (NAME/tables.py) says what to print as data, a `Report` of `Table`s
and `Line`s; this module prints it: the tables through rich at the width the report asks
for (a pipe reports 80 columns, too few for most), and with --markdown its Markdown parts.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text


@dataclass(frozen=True)
class Table:
    """A table: the numbers right-aligned, the column `left` (the names) left-aligned."""

    title: str  # the console's heading; Markdown has none
    columns: Sequence[str]
    rows: Sequence[tuple[Hashable, Sequence[str]]]  # (group, cells): a rule where group changes
    left: str
    no_wrap: bool = False  # keep each cell on one line (a wide table: --markdown is narrower)


@dataclass(frozen=True)
class Line:
    """A line of text after (or between) the tables.

    to: "console" (wrapped at the report's width, rich markup read unless markup=False),
        "stdout" (printed as it is), or "stderr".
    """

    text: str
    to: Literal["console", "stdout", "stderr"] = "console"
    markup: bool = True


Part = Table | Line


@dataclass(frozen=True)
class Report:
    """What a benchmark prints: `parts` on the console, `markdown` with --markdown."""

    parts: Sequence[Part]
    width: int = 100  # the console's columns at least
    markdown: Sequence[Part] = ()  # nothing: the benchmark has no Markdown form here
    status: int = 0  # the exit status of `plait bench`


def ungrouped(rows: Iterable[Sequence[str]]) -> list[tuple[Hashable, Sequence[str]]]:
    """Rows of a table without sections."""
    return [(None, cells) for cells in rows]


def show(report: Report) -> None:
    """Print `report.parts`: the tables and console lines at `report.width` columns."""
    out = console(report.width)
    for part in report.parts:
        if isinstance(part, Table):
            out.print(_rich(part))
        elif part.to == "console":
            out.print(part.text, markup=part.markup, highlight=part.markup)
        else:
            print(part.text, file=sys.stderr if part.to == "stderr" else sys.stdout)


def markdown(parts: Sequence[Part]) -> str:
    """The parts as Markdown: each table (its columns, then its rows) or line, a blank line
    between them."""
    return "\n\n".join(
        markdown_table(p.columns, (cells for _, cells in p.rows))
        if isinstance(p, Table)
        else p.text
        for p in parts
    )


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header, its rule, then one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def console(min_width: int) -> Console:
    """A console at least `min_width` columns wide (a pipe reports 80, too few for a table)."""
    return Console(width=max(min_width, Console().width))


def _rich(t: Table) -> RichTable:
    """`t` as rich draws it, with a section rule wherever the rows' group changes."""
    table = RichTable(title=t.title)
    for col in t.columns:
        table.add_column(col, justify="left" if col == t.left else "right", no_wrap=t.no_wrap)
    last = None
    for group, cells in t.rows:
        if last is not None and group != last:
            table.add_section()
        last = group
        table.add_row(*(Text(c) for c in cells))  # data, not markup: a label's [...] shows
    return table


def ratio(value: float | None) -> str:
    """A ratio cell: '1.23x', or '' where there is nothing to compare with."""
    return "" if value is None else f"{value:.2f}x"


def number(value: Any, fmt: str) -> str:
    """`value` formatted by `fmt`, or '' for None."""
    return "" if value is None else format(value, fmt)

"""What every benchmark's report shares: paired ratios, medians, tables, Markdown.

The ratio between two ways measured in one run is paired by repeat: within a repeat the
ways ran back to back, so their ratio cancels the machine's drift between repeats (on a
shared 2-core machine that drift is larger than most differences being measured); the
report is the median of the per-repeat ratios, not the ratio of the medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """num[i] / den[i] for each repeat i (both lists one value per repeat, same order)."""
    return [a / b for a, b in zip(num, den, strict=True)]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median over repeats of num[i] / den[i].

    For times, `paired_ratio(peer_times, times)` is a speedup (> 1: faster than the peer);
    for throughputs, `paired_ratio(rates, peer_rates)` is.
    """
    return statistics.median(paired_ratios(num, den))


def median_or_none(values: Iterable[Any]) -> Any:
    """The median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(value: float | None) -> str:
    """A ratio cell: '1.23x', or '' where there is nothing to compare with."""
    return "" if value is None else f"{value:.2f}x"


def number(value: Any, fmt: str) -> str:
    """`value` formatted by `fmt`, or '' for None."""
    return "" if value is None else format(value, fmt)


def console(min_width: int) -> Console:
    """A console at least `min_width` columns wide (a pipe reports 80, too few for a table)."""
    return Console(width=max(min_width, Console().width))


def table(title: str, columns: Sequence[str], left: str) -> Table:
    """A table whose column `left` (the names) is left-aligned and the numbers right-aligned."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col == left else "right")
    return t


def add_rows(t: Table, rows: Iterable[tuple[Any, Sequence[str]]]) -> None:
    """Add (group, cells) rows to `t`, with a section line wherever the group changes."""
    last = None
    for group, cells in rows:
        if last is not None and group != last:
            t.add_section()
        last = group
        t.add_row(*cells)


def markdown(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header, its rule, then one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)

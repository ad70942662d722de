"""matplotlib, the optional extra every plot needs: imported on first use, drawing to files.

The house style of plait's figures lives here too, so every figure reads alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.errors import MissingExtraError

PLOT_INSTALL = "pip install 'plait[plot]'"
DPI = 120  # a 7-inch figure is ~840 pixels wide: sharp in a browser, small on disk


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only: no window, no display needed).

    Raises:
        MissingExtraError: matplotlib is not installed (the message has the pip command).
    """
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(
            f"plots need matplotlib, which is not installed. Install it with: {PLOT_INSTALL}  "
            "(or: pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(width: float = 7.0, height: float = 4.0, ncols: int = 1) -> tuple[Any, Any]:
    """A new figure and its axes, `ncols` panels side by side."""
    fig, axes = pyplot().subplots(1, ncols, figsize=(width, height), squeeze=ncols == 1)
    return fig, axes if ncols == 1 else list(axes[0])


def grid(ax: Any) -> None:
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.set_axisbelow(True)


def legend_below(fig: Any, ax: Any, ncols: int) -> None:
    """One legend for the figure, under its panels, so that it never hides a line."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=ncols,
               fontsize=8, frameon=False)  # fmt: skip


def plain_log_ticks(axis: Any) -> None:
    """Tick labels on a log axis as plain numbers (2, 5, 10), not 2x10^0."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)


def save(fig: Any, path: Path) -> Path:
    """Write `fig` to `path` as PNG and free it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    # "tight": the saved area grows to hold a legend placed outside the axes
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    pyplot().close(fig)
    return path

"""`plait train --tensorboard DIR`: rank 0's progress records as TensorBoard scalars.

The loop's records (report.py) go to the renderer and, through `tee`, here: the loss and
learning rate at every flush, samples/s at every log line, the held-out metric at every
evaluation, and the overlap ratio where a record carries one (`overlap_ratio`, from the
trace's metrics). The writer is torch.utils.tensorboard's, which needs the tensorboard
package: an optional extra, checked before any worker starts (`require`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from plait.train.errors import MissingExtraError
from plait.train.report import Emit, Record

TENSORBOARD_INSTALL = "pip install 'plait[tensorboard]'"


def require() -> None:
    """Raise MissingExtraError (with the pip command) unless tensorboard is installed."""
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["tensorboard"] is None
        found = False
    if not found:
        raise MissingExtraError(
            "--tensorboard writes through torch.utils.tensorboard, which needs the tensorboard "
            f"package, and it is not installed. Install it with: {TENSORBOARD_INSTALL}  (or: "
            "pip install tensorboard)"
        )


class Board:
    """A SummaryWriter fed the loop's records."""

    def __init__(self, logdir: str) -> None:
        require()
        from torch.utils.tensorboard import SummaryWriter

        self.writer: Any = SummaryWriter(log_dir=logdir)

    def handle(self, kind: str, rec: Record) -> None:
        w = self.writer
        if kind in ("loss", "log"):
            w.add_scalar("train/loss", rec["loss"], rec["step"])
            w.add_scalar("train/lr", rec["lr"], rec["step"])
        if kind == "log":  # samples/s over the window since the last log line
            w.add_scalar("train/samples_per_s", rec["samples_per_s"], rec["step"])
        if kind == "eval":
            w.add_scalar(f"eval/{rec['name']}", rec["value"], rec["step"])
        if "overlap_ratio" in rec and "step" in rec:
            w.add_scalar("comm/overlap_ratio", rec["overlap_ratio"], rec["step"])
        if kind == "finish":
            w.flush()

    def close(self) -> None:
        self.writer.close()


def tee(emit: Emit | None, board: Board | None) -> Emit | None:
    """`emit`, also feeding `board` (either may be None)."""
    if board is None:
        return emit
    if emit is None:
        return board.handle

    def both(kind: str, rec: Record) -> None:
        board.handle(kind, rec)
        emit(kind, rec)

    return both

"""`plait train --tensorboard DIR`: rank 0's progress records as TensorBoard scalars.

The loop's records (progress.py) go to the renderer and, through `tee`, here: the loss and
learning rate at every flush, samples/s at every log line, the held-out metric at every
evaluation, and with --trace the run's overlap ratio (the finish record's
`trace.overlap_ratio`, from plait.trace.metrics; absent without a trace). The writer is
torch.utils.tensorboard's, which needs the tensorboard package: an optional extra,
checked before any worker starts (`require`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from plait.train.errors import MissingExtraError
from plait.train.progress import Emit, Record

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
        if kind == "finish":
            # --trace's metrics, where the run was traced: one value for the whole run
            overlap = (rec.get("trace") or {}).get("overlap_ratio")
            if overlap is not None:
                w.add_scalar("comm/overlap_ratio", overlap, rec["steps"])
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

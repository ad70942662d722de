"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint holds the model's state_dict (the unwrapped module's), the optimizer's state,
the step, the data position, the RNG states, the losses so far, and the options that must
match to resume (model, data, workload, batch_size, seed, optimizer: another optimizer's
state would not fit; teacher: the run distils from the same one). Under data parallelism
every rank holds the same state, so rank 0 alone writes. The number of workers may change
between runs: the data stream depends on the global batch, not on how it is split.

Atomic: the bytes go to a temporary file in the same directory, are fsync'ed, and then
os.replace() puts the file in place (a rename, atomic on POSIX). A crash at any moment
leaves either the previous checkpoint or the new one, never a torn file. Beside it,
checkpoint.pt.sum records its size and sha256 (saved.py), checked before any worker reads it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from plait.options import flag
from plait.train import saved
from plait.train.errors import CheckpointError
from plait.train.outdir import check_resumable, check_writable
from plait.train.outdir import checkpoint_path as path

__all__ = ["check_matches", "check_writable", "load", "path", "rng_state", "save", "set_rng_state"]

FORMAT = 1
# options by name; "teacher": a distilled run resumes distilling from the same teacher
MUST_MATCH = ("model", "data", "workload", "batch_size", "seed", "optimizer", "teacher")


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))


def save(out: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write `state` to out/checkpoint.pt atomically; return the path.

    Raises:
        CheckpointError: the write failed; the previous checkpoint is untouched.
    """
    final = path(out)
    saved.save(final, lambda f: torch.save({"format": FORMAT, **state}, f))  # and its .sum
    return final


def load(out: str | os.PathLike[str]) -> dict[str, Any]:
    """Read out/checkpoint.pt.

    Raises:
        CheckpointError: there is none, or it cannot be read.
    """
    check_resumable(out)
    where = path(out)
    try:
        state: dict[str, Any] = torch.load(where, map_location="cpu", weights_only=True)
    except Exception as e:  # say why by its structure: torch's own reason may be empty
        why = saved.why_unreadable(where)
        raise CheckpointError(f"{where} {why}" if why else f"cannot read {where}: {e}") from e
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{where} has format {state.get('format')}; expected {FORMAT}")
    return state


def check_matches(state: dict[str, Any], options: dict[str, Any], where: str) -> None:
    """Raise CheckpointError if the checkpoint was written with other MUST_MATCH options."""
    theirs = state["options"]
    for key in MUST_MATCH:
        if key not in theirs:  # written before the option existed (optimizer): its default
            continue
        if theirs.get(key) != options.get(key):
            raise CheckpointError(
                f"the checkpoint in {where} was written by a run with {flag(key)} "
                f"{theirs.get(key)!r}, this run has {flag(key)} {options.get(key)!r}; resuming "
                f"needs the same {', '.join(map(flag, MUST_MATCH))}"
            )

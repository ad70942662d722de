"""Where a run writes: its checkpoint directory (--out) and its figures (--json).

No torch here: the command line checks both before it starts any worker.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

from plait.sharded.filenames import MANIFEST, PLAIN
from plait.train.errors import CheckpointError


def checkpoint_path(out: str | os.PathLike[str]) -> Path:
    """Where the checkpoint of output directory `out` lives."""
    return Path(out) / PLAIN


def check_writable(out: str | os.PathLike[str]) -> None:
    """Create `out` if needed and check that files can be written there.

    Raises:
        CheckpointError: it cannot be created or written (the message says why).
    """
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".plait-probe-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise CheckpointError(f"cannot write checkpoints to {str(out)!r}: {reason}") from None


def check_resumable(
    out: str | os.PathLike[str], sharded: bool = False, *, manifest: str = MANIFEST
) -> None:
    """Raise CheckpointError unless `out` holds a checkpoint (`sharded`: its manifest, by
    the name `manifest`: a parameter-server run's is plait/ps/run_files.py's)."""
    where = Path(out) / manifest if sharded else checkpoint_path(out)
    if where.is_file():
        return
    other = checkpoint_path(out) if sharded else Path(out) / MANIFEST
    hint = ""
    if other.is_file() and manifest == MANIFEST:
        hint = (f"; {other.name} there is a plain checkpoint (a run without --zero): resume "
                "it without --zero" if sharded else
                f"; {other.name} there is a sharded checkpoint (a run with --zero): resume it "
                "with --zero 1, 2 or 3")  # fmt: skip
    raise CheckpointError(f"no checkpoint to resume from: {where} does not exist{hint}")


def check_file_writable(target: str | os.PathLike[str], what: str = "--json") -> None:
    """Raise CheckpointError unless a file can be created at `target` (its folder exists)."""
    folder = Path(target).parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".plait-probe-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise CheckpointError(f"cannot write {what} {str(target)!r}: {reason}") from None


RESUME_FLAG = "--resume"  # CheckpointConfig.resume's option; it needs --out DIR, as given


def resume_hint(
    out: str, sharded: bool, argv: Sequence[str] | None, *, manifest: str = MANIFEST
) -> str:
    """What to tell the user after a run with --out `out` failed: the command that resumes it.

    Args:
        out: the run's --out directory.
        sharded: the run writes sharded checkpoints (--zero): its manifest is what resumes.
        manifest: that manifest's name (a parameter-server run's differs).
        argv: the user's command line after the program name (`train --out x ...`), or
            None when the run was not started from the command line.
    """
    try:
        check_resumable(out, sharded=sharded, manifest=manifest)
    except CheckpointError:
        return f"plait train: no checkpoint was written to {out} yet: there is nothing to resume"
    if argv is None:
        return (f"plait train: to resume from the last checkpoint in {out}, run the same "
                f"command with {RESUME_FLAG}")  # fmt: skip
    args = list(argv)
    if not any(a == RESUME_FLAG or a.startswith(RESUME_FLAG + "=") for a in args):
        args.append(RESUME_FLAG)
    return f"plait train: to resume from the last checkpoint in {out}: plait {shlex.join(args)}"

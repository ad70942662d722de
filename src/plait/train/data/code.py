"""`code`: a byte-level corpus of the Python standard library's own source on this machine.

The .py files under `sysconfig.get_paths()["stdlib"]` (sorted paths; test suites,
site-packages, codec tables and a few demo/tool folders skipped), concatenated up to
MAX_BYTES. Tokens are
bytes (vocabulary 256), so there is no vocabulary to build or store. The last 10% of the
stream is the validation split. The corpus depends on the Python installation, so runs are
comparable on one machine (the byte count is printed with the results).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from plait.train.data.base import LanguageModelling

MAX_BYTES = 16_000_000  # CPython 3.11: ~9.6 MB in 455 files, read in ~0.3 s; no cache needed
VAL_FRACTION = 0.1
SKIP_DIRS = {
    "__pycache__", "test", "tests", "idle_test", "site-packages", "dist-packages",
    "idlelib", "turtledemo", "lib2to3", "ensurepip", "encodings",
}  # fmt: skip


def source_files(root: Path) -> list[Path]:
    """The standard library's .py files under `root`, in sorted order, tests left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        files += [
            Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("test_")
        ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus(root: Path | None = None, max_bytes: int = MAX_BYTES) -> bytes:
    """The concatenated source bytes (at most `max_bytes`)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    parts: list[bytes] = []
    total = 0
    for path in source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data[: max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no Python source files found under {root}")
    return b"".join(parts)


def load(*, task: str = "lm", block_size: int = 64) -> LanguageModelling:
    """The corpus as a byte stream: first 90% train, last 10% validation."""
    stream = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    n_val = int(stream.numel() * VAL_FRACTION)
    return LanguageModelling(
        name="code",
        train_tokens=stream[:-n_val],
        val_tokens=stream[-n_val:],
        vocab_size=256,
        block_size=block_size,
        token="byte",
    )

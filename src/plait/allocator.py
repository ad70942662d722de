"""glibc's malloc as a training rank wants it: memory a step frees kept for the next step.

By default glibc gives a large freed block back to the system (munmap, or trimming the
heap's top once twice its adaptive mmap threshold is free), so a step that frees and
allocates again a tensor of many MiB (a gradient, the optimizer's temporaries: wide's
4.2M-parameter layer, 16 MiB each) page-faults it back in every step, in the kernel's time:
sgd's step over wide took 24 ms (8k faults) instead of 8. Kept (every block from the heap,
no mmap; the heap never trimmed), the memory a step frees serves the next, as PyTorch's
CUDA caching allocator does on a GPU.

Two ways to the same settings: the environment, read by glibc when a process starts
(`ENV`, what `plait train` gives the workers it starts), and mallopt at run time
(`keep_freed`, what a rank started by another launcher, torchrun or `plait run`, does
itself; `kept`, for a while only: the planner's profile). A setting the environment
already has is the user's and wins. Nothing happens where the C library is not glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

# mallopt's parameters (glibc malloc/malloc.h), their environment names, the values kept
# (-1 for the trim threshold is read as unsigned: never trim), and what `kept` leaves after
_PARAMS = {  # name: (mallopt parameter, kept value, after)
    "MALLOC_MMAP_MAX_": (-4, 0, 65536),  # glibc's default
    "MALLOC_TRIM_THRESHOLD_": (-1, -1, 64 << 20),  # twice the mmap threshold, as glibc's
}
_M_MMAP_THRESHOLD = -3
# glibc raises its mmap threshold as large blocks are freed, up to 32 MiB on 64 bits; any
# mallopt freezes it where it is, and a threshold frozen low makes every larger tensor an
# mmap and a munmap: 16 MiB tensors made 20x slower. So `kept` leaves it at that ceiling
_MMAP_THRESHOLD_AFTER = 32 << 20
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**64 - 1)}


def keep_freed(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Keep what this process frees from now on (module docstring), but for the settings
    `environ` already has. Returns the names of those set here."""
    libc = _glibc()
    if libc is None:
        return []
    done = []
    for name, (param, value, _default) in _PARAMS.items():
        if name not in environ:
            libc.mallopt(param, value)
            done.append(name)
    return done


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Keep what this process frees while inside (a profile timed as the workers run), then
    let glibc return large blocks again, as its own adaptive thresholds end up doing (the
    mmap threshold at its 32 MiB ceiling, trimming beyond twice that): any mallopt stops
    their adapting, so they are set where adapting would have taken them."""
    libc = _glibc()
    if libc is None:
        yield
        return
    for param, value, _default in _PARAMS.values():
        libc.mallopt(param, value)
    try:
        yield
    finally:
        for param, _value, after in _PARAMS.values():
            libc.mallopt(param, after)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_AFTER)


def _glibc() -> Any:
    """The C library when it is glibc (it has mallopt's parameters above), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError under musl)
    except (OSError, AttributeError, TypeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc

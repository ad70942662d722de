"""`plait train --compile`: torch.compile on what each rank runs, timed apart from the steps.

- What is compiled: the forward of the model each rank runs (steps/compute.py's
  `Compiled`), so parameter names, `state_dict` keys and checkpoints are those of the eager
  model. With --pp a rank runs one pipeline stage and compiles that: the stage boundaries
  are where the pipeline sends activations, so no graph may cross them. Under DataParallel
  the gradients of a compiled model land at the end of its one backward graph, so the
  buckets' allreduce no longer overlaps the backward (torch DDP splits the graph per bucket
  for that; here the 2-core CPU has no core to overlap with anyway).
- When: torch.compile compiles at the first call, forward and backward alike. The loop runs
  one forward and backward before its clock starts (`warm_up`), so samples/s counts steps
  only and the compile time is printed on its own. The first evaluation compiles the
  no-grad graph too, off the clock as every evaluation is.
- What it needs: on the CPU, inductor writes C++ and builds it with $CXX (default g++),
  including Python's C headers; on a GPU, Triton builds a small C launcher with $CC (or
  cc, gcc, clang), with the same headers. A machine with only Python and pip has neither a
  compiler nor, on Debian and Ubuntu, the headers (python3-dev): `check` says so before any
  worker starts, instead of an inductor traceback at the first step.

This module imports torch only inside `warm_up`.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.train.errors import ConfigError

C_COMPILERS = ("cc", "gcc", "clang")  # what Triton tries when $CC is unset


def check(device: str) -> None:
    """Raise ConfigError unless torch.compile can build kernels for `device` here.

    Raises:
        ConfigError: no C++ compiler (the CPU) or C compiler (CUDA) on PATH, or no Python.h.
    """
    if device == "cuda":
        wanted = [os.environ["CC"]] if os.environ.get("CC") else list(C_COMPILERS)
        what, variable = "a C compiler (Triton builds its kernel launcher with it)", "CC"
    else:  # auto may turn out to be a GPU; its CPU code needs the C++ compiler all the same
        wanted = [os.environ.get("CXX") or "g++"]
        what, variable = "a C++ compiler (inductor builds its CPU kernels with it)", "CXX"
    if not any(shutil.which(c) for c in wanted):
        raise ConfigError(
            f"--compile needs {what}, and no {' or '.join(wanted)} is on PATH. pip cannot "
            "install one: install it with the system's package manager (Debian/Ubuntu: "
            "apt-get install g++; Fedora: dnf install gcc-c++; macOS: xcode-select "
            f"--install), or name yours in ${variable}; or leave out --compile"
        )
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        raise ConfigError(
            f"--compile needs Python's C headers, and {include / 'Python.h'} is missing: the "
            "kernels torch.compile builds are Python extensions. Install them "
            "(Debian/Ubuntu: apt-get install python3-dev), or leave out --compile"
        )


def warm_up(forward_backward: Callable[[], Any]) -> float:
    """Run `forward_backward` once, for torch.compile to compile; return its seconds.

    The RNG state is put back afterwards, so the run's dropout masks and losses are those of
    a run without the warm-up (the Steps zero the gradients before each step anyway).
    """
    import torch

    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    began = time.perf_counter()
    with torch.random.fork_rng(devices=gpus):
        forward_backward()
    if gpus:
        torch.cuda.synchronize()  # the kernels it queued are part of the first step
    return time.perf_counter() - began

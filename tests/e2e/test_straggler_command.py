"""The straggler hook's transient draws are the same in every process: checked in separate
processes."""

from __future__ import annotations

import os
import subprocess
import sys

from plait.train.straggler import Straggler

DRAWS = (
    "from plait.train.straggler import Straggler; "
    "s = Straggler(factor=2.0, mode='transient', seed=11); "
    "print([s.slowed(k, 5) for k in range(1, 101)])"
)


def test_every_process_draws_the_same() -> None:
    # each worker is a process with its own hash seed: the draw must not depend on it
    outs = {
        subprocess.run([sys.executable, "-c", DRAWS], capture_output=True, text=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    here = Straggler(factor=2.0, mode="transient", seed=11)
    assert outs == {f"{[here.slowed(k, 5) for k in range(1, 101)]}\n"}

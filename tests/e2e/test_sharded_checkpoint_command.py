"""`plait checkpoint consolidate` writes a state_dict that torch loads (the checkpoints
themselves are in tests/unit/test_sharded_checkpoint.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from support.paths import ROOT
from support.sharded_states import Model, save_all


def test_the_command_writes_a_state_dict_torch_loads(tmp_path: Path) -> None:
    model = Model()
    save_all(tmp_path / "run", model, 4)
    out = tmp_path / "model.pt"
    done = subprocess.run(
        [sys.executable, "-m", "plait", "checkpoint", "consolidate", str(tmp_path / "run"),
         "-o", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "reading" in done.stderr and "rank3-of-4.pt (4/4)" in done.stderr
    size = out.stat().st_size
    assert (
        done.stdout.strip() == f"wrote {out}: 7 parameters (64 values), 2 buffers, {size:,} bytes"
    )
    state = torch.load(out, weights_only=True)
    assert state.keys() == {**model.params, **model.buffers}.keys()
    assert all(torch.equal(state[n], t) for n, t in model.params.items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

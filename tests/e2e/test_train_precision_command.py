"""`plait train --precision` through the real command: what it prints and the figures it writes
(the options in worlds are in tests/world/test_train_precision.py). The run is the session's
"ps precision" (tests/support/shared_runs.py), whose listeners tests/e2e/test_abuse.py
watches."""

from __future__ import annotations

import json

import pytest

from support.shared_runs import SharedRuns


@pytest.mark.timeout(300)
def test_plait_train_prints_and_writes_the_figures(shared_runs: SharedRuns) -> None:
    # the parameter server takes bf16 and checkpointing (its workers do the arithmetic):
    # gpt, --strategy ps --workers 2 --servers 1 --precision bf16 --activation-checkpointing
    res = shared_runs.result("ps precision")
    assert res.returncode == 0, res.stderr
    assert "compute: bf16 autocast, activation checkpointing" in res.stdout
    assert "precision            bf16 compute" in res.stdout
    assert "checkpointed         4 blocks (blocks.0 to blocks.3)" in res.stdout
    figures = json.loads((res.folder / "run.json").read_text())
    assert figures["precision"] == "bf16" and len(figures["checkpointed_blocks"]) == 4
    assert figures["activation_bytes"] > 0 and figures["compile_s"] is None

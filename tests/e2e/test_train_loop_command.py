"""The real `plait train` command: a run end to end, a NaN loss through the command line, and
`plait train` under a launcher as the worker, there with --compression (the loop in worlds is
in tests/world/test_train_loop.py, every compression method's figures in a world too). The
three commands run at once, once for the module."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from plait.train import checkpoint
from support.commands import Command, commands_at_once

Ran = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]  # each command's folder, end
COMPRESSION = "topk:0.05"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Each command's folder and how it ended."""
    where = {name: tmp_path_factory.mktemp(name) for name in ("run", "nan", "launched")}
    done = commands_at_once({
        "run": Command(["-m", "plait", "train", "--steps", "20", "--workers", "2",
                        "--json", str(where["run"] / "run.json")]),
        # one worker: what the command shows (exit 3, the message, the last checkpoint); a
        # NaN on one rank of several is tests/world/test_train_loop.py's
        "nan": Command(["-m", "plait", "train", "--steps", "12", "--workers", "1",
                        "--out", str(where["nan"]), "--checkpoint-every", "2", "--log-every", "5"],
                       env={"PLAIT_TRAIN_NAN_AT": "5"}),
        # RANK/WORLD_SIZE set (plait run, torchrun): train as that rank, world size from the
        # job; a real --compression run too (top-k: its bytes follow from k alone)
        "launched": Command(["-m", "plait", "run", "-n", "2", "-m", "plait", "train",
                             "--steps", "6", "--compression", COMPRESSION,
                             "--json", str(where["launched"] / "run.json")]),
    })  # fmt: skip
    return {name: (where[name], done[name]) for name in where}


@pytest.mark.timeout(120)
def test_plait_train_end_to_end(ran: Ran) -> None:
    folder, res = ran["run"]
    figures = folder / "run.json"
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(figures.read_text())
    for key in ("strategy", "world_size", "steps", "global_batch", "final_loss", "eval_name",
                "eval_value", "samples_per_s", "wall_s"):  # fmt: skip
        assert key in data
    assert (data["strategy"], data["world_size"], data["steps"]) == ("allreduce", 2, 20)
    assert data["global_batch"] == 64 and data["eval_name"] == "held-out accuracy"
    assert 0.5 < data["eval_value"] <= 1.0 and data["final_loss"] < 2.3
    assert data["samples_per_s"] > 0 and data["wall_s"] > 0
    assert "summary:" in res.stdout and "held-out accuracy" in res.stdout
    assert "[rank 0]" not in res.stdout  # rank 0 speaks for the job, unprefixed


@pytest.mark.timeout(120)
def test_nan_through_the_command_line(ran: Ran) -> None:
    tmp_path, res = ran["nan"]
    assert res.returncode == 3, res.stdout + res.stderr
    assert "the training loss is nan at step 5" in res.stderr
    assert "last good checkpoint (step 4)" in res.stderr
    assert "Traceback" not in res.stderr
    assert checkpoint.load(tmp_path)["step"] == 4


@pytest.mark.timeout(120)
def test_under_a_launcher_plait_train_is_the_worker(ran: Ran) -> None:
    _, res = ran["launched"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("[rank 0] summary:") == 1 and "[rank 1]" not in res.stdout
    assert "2 workers" in res.stdout


@pytest.mark.timeout(120)
def test_plait_train_compression(ran: Ran) -> None:
    folder, res = ran["launched"]
    assert res.returncode == 0, res.stderr
    figures = json.loads((folder / "run.json").read_text())
    assert figures["compression"] == COMPRESSION
    dense, sent = figures["allreduce_bytes"], figures["sent_bytes"]
    assert dense < 2**20  # one bucket (the first is 1 MiB): the formula below holds
    n = dense // 4  # fp32 gradients
    assert sent == -(-n // 20) * (4 + 4)  # k = ceil(n / 20) fp32 values, int32 indices
    assert f"compression          {COMPRESSION}: " in res.stdout
    assert figures["losses"][-1] < figures["losses"][0]

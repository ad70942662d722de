"""`--device` through the command line: torch's build read without importing it, `--device
cuda` without a GPU one line and exit status 2, `--device cpu` trains and says so (the
session's "observe" run, tests/support/shared_runs.py), and --help lists the options (the
device choice itself is in tests/unit/test_devices.py; what needs a GPU in
tests/world/test_train_cuda.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from plait.train import device as train_device
from support.shared_runs import OBSERVE_STEPS, SharedRuns


def test_the_installed_torch_build_is_read_without_importing_it() -> None:
    cpu_only = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    assert train_device.cpu_only_torch() == cpu_only
    code = "import sys; from plait.train import device; device.cpu_only_torch(); " + (
        "device.check('auto', 0, 4); print('torch' in sys.modules)"
    )
    if cpu_only:  # auto on a CPU-only build: nothing to check, and torch stays unloaded
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stdout.strip() == "False", out.stderr


def _plait(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        capture_output=True, text=True, timeout=110, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.timeout(120)
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2() -> None:
    res = _plait("train", "--device", "cuda")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("plait train: error: device cuda was asked for")
    assert "--device cpu" in lines[0] and "Traceback" not in res.stderr
    assert res.stdout == ""  # no worker was started
    bad = _plait("train", env={"PLAIT_DEVICE": "gpu"})
    assert bad.returncode == 2 and "PLAIT_DEVICE must be auto, cpu or cuda; got 'gpu'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.timeout(180)
def test_device_cpu_trains_and_says_so(shared_runs: SharedRuns) -> None:
    res = shared_runs.result("observe")  # two workers, --device cpu (and --trace, ...)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((res.folder / "run.json").read_text())
    assert (data["device"], data["world_size"], data["steps"]) == ("cpu", 2, OBSERVE_STEPS)
    assert all(v == v for v in data["losses"])  # finite, not NaN
    assert ", on cpu" in res.stdout  # the run's header names where it ran


def test_help_lists_the_device_options() -> None:
    res = _plait("train", "--help")
    assert res.returncode == 0
    assert "--device {auto,cpu,cuda}" in res.stdout and "--tf32" in res.stdout
    assert "PLAIT_DEVICE" in res.stdout

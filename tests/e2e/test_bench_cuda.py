"""`plait bench collectives|train --device cuda`: refused in one line where no GPU is, the
device's config checks, and, marked `cuda`, tiny real runs on a GPU machine (2 ranks,
sharing one GPU if it has one). Merging the per-transport launches into one report is in
tests/unit/test_bench_cuda_report.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait import devices

NO_GPU = not torch.cuda.is_available()


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "plait", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal where no GPU is visible")
@pytest.mark.parametrize("name", ["collectives", "train"])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(name: str) -> None:
    proc = bench(name, "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"plait bench {name}: device cuda was asked for"), lines[0]
    assert "--device cpu" in lines[0] and proc.stdout == ""


def test_config_checks_of_device() -> None:
    from plait.bench.collectives.config import CollectivesConfig
    from plait.bench.train.config import TrainBenchConfig
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="drop --hosts"):
        CollectivesConfig(device="cuda", hosts=2)
    with pytest.raises(ConfigError, match="--device must be one of cpu, cuda; got 'gpu'"):
        TrainBenchConfig(device="gpu")
    proc = bench("collectives", "--device", "gpu")
    assert proc.returncode == 2 and "invalid choice: 'gpu'" in proc.stderr


# ------------------------------------------------------------------- on a GPU machine
def gpu_env() -> dict[str, str]:
    """Two ranks on this machine's GPUs (sharing one if need be)."""
    return {"PLAIT_SHARE_GPU": "1", "PLAIT_TIMEOUT": "60"}


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_bench_collectives_on_gpus(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cal = tmp_path / "cal.json"
    nccl = devices.nccl_problem(2) is None
    args = ["collectives", "--device", "cuda", "-n", "2", "--sizes", "64K,1M", "--repeats", "2",
            "--budget", "0.3", "--json", str(out)]  # fmt: skip
    if nccl:
        args.append("--calibrate")
    proc = bench(*args, env={**gpu_env(), "PLAIT_CALIBRATION": str(cal)}, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    staged = {"ring/staged", "halving_doubling/staged", "tree/staged", "native/staged"}
    for cells in data["results"].values():
        if nccl:
            want = {"torch", "native", "ring", "halving_doubling", "tree", "auto", "torch/staged"}
            assert set(cells) == want | staged
        else:  # NCCL cannot join the ranks: the staged rows alone, without torch's
            assert set(cells) == staged
        assert all(min(ts) > 0 for ts in cells.values())
    assert data["device"]["gpus"] == torch.cuda.device_count()
    assert data["device"]["cuda"] == torch.version.cuda
    assert "CUDA tensors" in proc.stdout and "device: " in proc.stdout
    if nccl:  # the calibration is kept apart from the CPU one
        points = json.loads(cal.read_text())["points"]
        assert set(points) == {"cuda-p2-n1"}
        assert set(points["cuda-p2-n1"]["allreduce"]) == {
            "native",
            "ring",
            "halving_doubling",
            "tree",
        }


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_bench_train_on_gpus(tmp_path: Path) -> None:
    problem = devices.nccl_problem(2)
    if problem is not None:
        pytest.skip(f"DDP's NCCL cannot run 2 ranks here: {problem}")
    out = tmp_path / "train.json"
    args = ["train", "--device", "cuda", "--nproc", "2", "--workloads", "mlp,cnn", "--global-batch",
            "8", "--steps", "2", "--repeats", "2", "--json", str(out)]  # fmt: skip
    proc = bench(*args, env=gpu_env(), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    [run] = data["runs"]
    assert run["device"]["gpus"] == torch.cuda.device_count()
    for w in run["workloads"].values():
        assert all(len(v) == 2 and min(v) > 0 for v in w["samples_per_s"].values())
    assert "DDP (NCCL, on GPUs)" in proc.stdout

"""The job's device (plait.devices) on a machine without a GPU.

`devices.resolve` is checked against every case of its contract with torch.cuda's answers
replaced (no GPU, one, two), so these run anywhere; so do the checks `plait train` makes
before starting workers (train/device.py). The command line, run for real, is in
tests/e2e/test_devices_command.py; what needs a GPU in tests/world/test_train_cuda.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plait import devices
from plait.errors import ConfigError
from plait.train import device as train_device
from plait.train.config import TrainConfig
from plait.train.parts import DEVICES, DeviceConfig

Gpus = Callable[[int], None]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Gpus:
    """Set how many GPUs torch sees (0: none); PLAIT_SHARE_GPU starts unset."""
    monkeypatch.delenv("PLAIT_SHARE_GPU", raising=False)

    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return visible


def _each(requested: str, local_size: int) -> list[str]:
    return [str(devices.resolve(requested, r, local_size)) for r in range(local_size)]


# ------------------------------------------------------------------ devices.resolve
def test_auto_is_the_cpu_without_a_gpu_and_a_gpu_per_rank_with_them(gpus: Gpus) -> None:
    gpus(0)
    assert _each("auto", 4) == ["cpu"] * 4
    assert _each("cpu", 4) == ["cpu"] * 4
    gpus(2)
    assert _each("auto", 2) == ["cuda:0", "cuda:1"]
    assert _each("cuda", 2) == ["cuda:0", "cuda:1"]
    assert _each("cpu", 2) == ["cpu", "cpu"]  # asked for: the GPUs are left alone


def test_cuda_without_a_gpu_says_why(gpus: Gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(devices.DeviceError, match="CPU-only build; use --device cpu"):
        devices.resolve("cuda", 0, 1)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(devices.DeviceError, match=r"\(CUDA 12.4\) sees no GPU"):
        devices.resolve("cuda", 0, 1)
    assert issubclass(devices.DeviceError, ConfigError)  # plait train's exit status 2


def test_more_ranks_than_gpus_needs_plait_share_gpu(
    gpus: Gpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(1)
    for requested in ("auto", "cuda"):
        with pytest.raises(devices.DeviceError, match=r"runs 2 ranks but has 1 GPU\(s\)") as e:
            devices.resolve(requested, 1, 2)
        assert "PLAIT_SHARE_GPU=1" in str(e.value) and "--device cpu" in str(e.value)
    monkeypatch.setenv("PLAIT_SHARE_GPU", "1")
    assert _each("cuda", 2) == ["cuda:0", "cuda:0"]
    gpus(2)
    assert _each("auto", 3) == ["cuda:0", "cuda:1", "cuda:0"]  # rank % GPUs


def test_an_unknown_device_names_the_choices(gpus: Gpus) -> None:
    gpus(0)
    with pytest.raises(devices.DeviceError, match="one of auto, cpu, cuda; got 'gpu'"):
        devices.resolve("gpu", 0, 1)
    assert devices.CHOICES == DEVICES  # plait train's copy (its options import no torch)


# ------------------------------------------------------------- plait train's checks


def test_check_before_workers_start(gpus: Gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_device, "cpu_only_torch", lambda: False)
    gpus(1)
    train_device.check("cpu", 0, 8)
    train_device.check("cuda", 0, 1)
    with pytest.raises(devices.DeviceError, match="runs 4 ranks but has 1 GPU"):
        train_device.check("auto", 0, 4)
    monkeypatch.setenv("PLAIT_SHARE_GPU", "1")
    train_device.check("auto", 0, 4)
    gpus(0)
    with pytest.raises(devices.DeviceError, match="cuda was asked for"):
        train_device.check("cuda", 0, 1)
    train_device.check("auto", 0, 4)


def test_local_place_of_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert train_device.local_place(4, launched=False) == (0, 4)
    assert train_device.local_place(4, launched=True) == (0, 4)  # no torchrun variables
    # 2 hosts of 4 ranks, 6 workers then 2 servers: host 1 runs workers 4 and 5 only
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for rank, place in ((1, (1, 4)), (5, (1, 2)), (7, (3, 2))):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 4))
        assert train_device.local_place(6, launched=True) == place
    assert train_device.local_place(6, launched=False) == (0, 6)  # the parent: all of them


def test_a_step_takes_the_job_device_unless_told_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        monkeypatch.setattr(devices, "device", lambda: torch.device("cuda", 1))
        on = TrainConfig.from_options({"device": "auto", "tf32": True})
        assert train_device.of(on) == torch.device("cuda", 1)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert train_device.of(TrainConfig.from_options({"device": "cuda"})) == torch.device(
            "cuda", 1
        )
        assert not torch.backends.cuda.matmul.allow_tf32  # --tf32 off: exact float32
        assert not torch.backends.cudnn.allow_tf32  # (torch's own default is on for cuDNN)
        assert train_device.of(TrainConfig.from_options({"device": "cpu"})).type == "cpu"
        monkeypatch.setattr(devices, "device", lambda: torch.device("cpu"))
        with pytest.raises(ConfigError, match="device cuda was asked for, but this rank"):
            train_device.of(TrainConfig.from_options({"device": "cuda"}))
        assert train_device.of(TrainConfig()).type == "cpu"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_the_device_option_defaults_to_plait_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAIT_DEVICE", raising=False)
    assert TrainConfig().device == DeviceConfig(name="auto", tf32=False)
    monkeypatch.setenv("PLAIT_DEVICE", "cpu")
    assert TrainConfig().device.name == "cpu"
    assert TrainConfig.from_options({"device": "cuda"}).device.name == "cuda"  # given wins
    monkeypatch.setenv("PLAIT_DEVICE", "gpu")
    with pytest.raises(ConfigError, match="PLAIT_DEVICE must be auto, cpu or cuda; got 'gpu'"):
        TrainConfig()
    with pytest.raises(ConfigError, match="device 'tpu' is not one of"):
        DeviceConfig(name="tpu")
    # what a worker reads back is the value decided here, whatever its environment says
    made = TrainConfig.from_options({"device": "cpu"})
    assert TrainConfig.from_dict(made.to_dict()).device.name == "cpu"


# ----------------------------------------------------------------- the command line

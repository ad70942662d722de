"""`plait train --device`: checked before any worker starts, then taken by every Step.

The job's device is plait's (plait/devices.py): `plait.init()` resolves PLAIT_DEVICE for each
rank (cuda:LOCAL_RANK where GPUs are), and `plait train` sets PLAIT_DEVICE for its workers
from `--device`. Here is what `plait train` adds around it:

- `check`, before any worker starts: `--device cuda` where no GPU is, or more workers on a
  host than GPUs (without PLAIT_SHARE_GPU), is one line and exit status 2 (job.configure).
  It imports torch only where torch could see a GPU: a CPU-only build of torch says so in
  the `torch/version.py` it ships, read here as text, so `plait train` on a CPU machine
  starts as fast as before.
- `local_place`: a parameter-server worker's place among its host's workers, for the GPU
  it takes (servers run on the CPU and take none); the others' is plait.init()'s.
- `of`, in every Step: the device this rank's model and batches go to, and the TF32
  setting (`--tf32`) on CUDA.

This module imports torch only inside `of` and, for a build that may have GPUs, `check`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from plait.train.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from plait.train.config import TrainConfig


def check(name: str, local_rank: int, local_size: int) -> None:
    """Raise now what `plait.init()` would raise on local rank `local_rank` of `local_size`
    ranks that compute on a GPU (their host's workers) for device `name`.

    Raises:
        DeviceError (a ConfigError): cuda where torch sees no GPU, or more ranks on the host
            than GPUs without PLAIT_SHARE_GPU=1.
    """
    if name == "cpu" or (name == "auto" and cpu_only_torch()):
        return  # auto on a CPU-only build is the CPU: nothing can fail
    from plait import devices

    devices.resolve(name, local_rank, local_size)


def cpu_only_torch() -> bool:
    """Whether the installed torch is a build without CUDA and ROCm, from its version.py
    (`cuda = None`, `hip = None`), without importing torch. False when unsure."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    values: dict[str, object] = {}
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        for node in ast.parse(text).body:
            target: ast.expr
            if isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            else:
                continue
            if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and value:
                values[target.id] = ast.literal_eval(value)
    except (OSError, SyntaxError, ValueError):
        return False
    return values == {"cuda": None, "hip": None}


def local_place(workers: int, launched: bool) -> tuple[int, int]:
    """(this rank's index among its host's workers, how many workers its host runs).

    Outside a launcher: (0, workers), the `plait train` process about to start them all.
    Under one, from torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE and RANK: a host's ranks are
    numbered contiguously, and parameter servers are the job's last ranks, so a host whose
    first rank is F runs min(LOCAL_WORLD_SIZE, workers - F) workers.
    """
    if not launched or "LOCAL_RANK" not in os.environ:
        return 0, workers
    local_rank = int(os.environ["LOCAL_RANK"])
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    first = int(os.environ.get("RANK", local_rank)) - local_rank
    return local_rank, max(1, min(local_size, workers - first))


def of(config: TrainConfig) -> torch.device:
    """The device this rank trains on: the job's (`plait.device()`, chosen when the rank
    joined) unless the config says cpu; on CUDA, TF32 set as `--tf32` says.

    Raises:
        ConfigError: the config says cuda, but the job's device is the CPU (a config made in
            Python, trained in a job whose PLAIT_DEVICE was cpu).
    """
    import torch

    from plait import devices

    name = config.device.name
    job = devices.device()
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" and job.type != "cuda":
        raise ConfigError(
            f"device cuda was asked for, but this rank joined the job on {job}: set "
            "PLAIT_DEVICE=cuda before plait.init() (plait train does), or use device cpu"
        )
    if job.type == "cuda":
        # torch's defaults differ (matmuls off, cuDNN convolutions on): one switch for both
        torch.backends.cuda.matmul.allow_tf32 = config.device.tf32
        torch.backends.cudnn.allow_tf32 = config.device.tf32
    return job

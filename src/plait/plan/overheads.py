"""What a training step costs beyond the profile, fitted once per machine and cached.

The profile (profile.py) times each layer alone, on one thread, the fastest of a few runs.
A real step pays more: Python's cost per pipeline action and per message, per gradient
bucket and per collective call, a fixed cost per step (loading data, clipping's norm
allreduce, the optimizer's fixed part, the loop's loss flush), compute slower than the
profile's best, and ranks sharing cores and memory bandwidth. `Overheads` holds one figure
for each; `plait plan --calibrate` fits them from short real runs (fit.py), and
`plait plan --from-trace` refits them from a traced run. The defaults add nothing: a
planner without a calibration predicts what the profile alone says.

Cached as JSON under $XDG_CACHE_HOME/plait/overheads/ (~/.cache by default), keyed by the
host name, its CPU count and torch's version: the machine, not the model.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

VERSION = 1  # of the cached JSON's meaning: another version is ignored (calibrate again)


@dataclass(frozen=True)
class Overheads:
    """Seconds (and bytes) a step pays beyond the profile; all neutral by default."""

    compute_scale: float = 1.0  # a training rank's compute / the profile's (alone, best of 5)
    share: float = 1.0  # slowdown = 1 + share * (ranks per core - 1), where ranks > cores
    action: float = 0.0  # s per pipeline action (F, B, W), on the stage's compute queue
    message: float = 0.0  # s per point-to-point send, on the sender's compute queue
    bucket: float = 0.0  # s per DataParallel gradient bucket, on the compute queue
    collective: float = 0.0  # s per ZeRO unit collective or tensor-parallel allreduce call
    ps_request: float = 0.0  # s per parameter-server push or pull
    step_fixed: float = 0.0  # s per step: data, clipping, the optimizer's fixed part, the flush
    memory_rank: float = 0.0  # bytes every rank holds beyond what the model counts
    memory_margin: float = 0.0  # a plan fits when peak * (1 + margin) <= the limit
    fitted_from: tuple[str, ...] = ()  # what the figures were fitted on ("calibrate: dp2", ...)
    residuals: tuple[tuple[str, float], ...] = ()  # (source, relative error after the fit)

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Overheads:
        """Raises:
        ValueError: not an overheads file of this version."""
        data: dict[str, Any] = json.loads(text)
        if data.pop("version", None) != VERSION:
            raise ValueError("overheads of another version")
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["fitted_from"] = tuple(data.get("fitted_from", ()))
        data["residuals"] = tuple((str(k), float(e)) for k, e in data.get("residuals", ()))
        return cls(**data)


def cache_path(device: str = "cpu") -> Path:
    """This machine's overheads file for `device` ("cpu" or "cuda": which GPU too)."""
    import torch

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    key = f"{platform.node()}-c{os.cpu_count()}-torch{torch.__version__}"
    if device == "cuda":  # a GPU's overheads are not the CPU's, nor another GPU's
        key += "-cuda-" + torch.cuda.get_device_name()
    return Path(base) / "plait" / "overheads" / (re.sub(r"[^\w.-]+", "_", key) + ".json")


def load(device: str = "cpu") -> Overheads | None:
    """This machine's fitted overheads, or None where it was never calibrated."""
    try:
        return Overheads.from_json(cache_path(device).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save(overheads: Overheads, device: str = "cpu") -> Path:
    """Write this machine's overheads (atomically); returns the file."""
    path = cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(overheads.to_json())
    os.replace(tmp, path)
    return path

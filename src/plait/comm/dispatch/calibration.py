"""The calibration file: `plait bench collectives --calibrate`'s measurements, read by `auto`.

Calibration replaces the cost model's defaults with measurements of every algorithm at
several sizes at a world size: {world key: {collective: {algorithm: [[bytes, seconds],
...]}}}, and the two levels of the hierarchical allreduce measured apart. Between two
measured sizes the time is the alpha-beta line through them (`interpolate`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait import env


def calibration_path() -> Path:
    """Where calibration lives: $PLAIT_CALIBRATION, else ~/.cache/plait/calibration.json."""
    path = env.get("PLAIT_CALIBRATION")
    if path:
        return Path(path)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "plait"
        / "calibration.json"
    )


Points = list[list[float]]  # [[bytes, seconds], ...], ascending in bytes
_file: dict[str, Any] | None = None  # the calibration file as last read
_stamp: tuple[str, int, int, int] | None = None  # (path, inode, mtime_ns, size) of that read


def _read(reload: bool = False) -> dict[str, Any]:
    """The calibration file's contents ({} if none), parsed again only when the file changed.

    `auto` asks on every call, and parsing the file there cost more than some collectives
    (~50 us); a stat costs ~1 us. The file must be re-read when it changes: every rank has to
    choose the same algorithm for the same call (a rank choosing otherwise waits for messages
    its peers never send), and rank 0 rewrites the file while calibrating.
    """
    global _file, _stamp
    path = calibration_path()
    try:
        st = path.stat()
        # a rewrite is a new file (os.replace): its inode changes even within one mtime tick
        stamp: tuple[str, int, int, int] | None = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    if _file is None or reload or stamp != _stamp:
        try:
            data = json.loads(path.read_text()) if stamp is not None else {}
        except (OSError, ValueError):
            data = {}
        _file, _stamp = (data if isinstance(data, dict) else {}), stamp
    return _file


def _rewrite(change: Callable[[dict[str, Any]], None]) -> Path:
    """Apply `change` to the calibration file's contents as they are now, write them back
    atomically, and read them again."""
    data = _read(reload=True)
    change(data)
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    _read(reload=True)
    return path


def load_calibration(reload: bool = False) -> dict[str, dict[str, dict[str, Points]]]:
    """{world key: {collective: {algorithm: [[bytes, seconds], ...]}}}; {} if never calibrated."""
    points: dict[str, dict[str, dict[str, Points]]] = _read(reload).get("points", {})
    return points


def world_key(size: int, num_nodes: int, device: str = "cpu") -> str:
    """The calibration's key of a world: "p4-n1" for CPU tensors, "cuda-p4-n1" for CUDA ones."""
    key = f"p{size}-n{num_nodes}"
    return key if device == "cpu" else f"{device}-{key}"


def interpolate(points: Points, n: float) -> float:
    """Measured time at n bytes: the alpha-beta line through the two nearest calibrated
    sizes (a local alpha and beta; one global line misjudges the middle sizes, where the
    algorithms cross over), extended beyond the ends."""
    if len(points) == 1:
        return points[0][1]
    i = 0
    while i < len(points) - 2 and n > points[i + 1][0]:
        i += 1
    (n0, t0), (n1, t1) = points[i], points[i + 1]
    beta = max(0.0, (t1 - t0) / (n1 - n0)) if n1 != n0 else 0.0
    return max(t0 + beta * (n - n0), 1e-9)


def save_calibration(
    size: int, num_nodes: int, collective: str, points: dict[str, Points], device: str = "cpu"
) -> Path:
    """Merge one world size's measurements (on `device`'s tensors) into the calibration file
    (atomically)."""

    def change(data: dict[str, Any]) -> None:
        if not isinstance(data.get("points"), dict):
            data["points"] = {}
        data["points"].setdefault(world_key(size, num_nodes, device), {})[collective] = {
            a: sorted(p) for a, p in points.items()
        }
        data["note"] = (
            "median seconds per call at n bytes; written by plait bench collectives --calibrate"
        )

    return _rewrite(change)


def save_levels(size: int, num_nodes: int, levels: dict[str, tuple[float, float]]) -> Path:
    """Save the measured (alpha, beta) of each level of this world ("local", "network")."""

    def change(data: dict[str, Any]) -> None:
        data.setdefault("points", {})
        data.setdefault("levels", {})[world_key(size, num_nodes)] = {
            k: list(v) for k, v in levels.items()
        }

    return _rewrite(change)


def load_levels(size: int, num_nodes: int) -> dict[str, list[float]] | None:
    """The saved levels of this world, or None."""
    levels = _read().get("levels")
    found = levels.get(world_key(size, num_nodes)) if isinstance(levels, dict) else None
    return found if isinstance(found, dict) and {"local", "network"} <= found.keys() else None

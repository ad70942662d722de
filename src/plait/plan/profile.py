"""Each layer's cost, measured once per model and machine: forward and backward seconds,
parameters, and the bytes autograd keeps, as lines in the micro-batch size.

A layer is a pipeline layer (`GPT.layers()`, an `nn.Sequential`'s children:
`plait.train.workload.stages`), the unit a pipeline stage is cut from. Each is timed on
the output of the one before, on one thread (as a worker runs: OMP_NUM_THREADS=1), the
fastest of `REPEATS` runs after one warm-up (others' load only adds), the last layer
with the workload's loss. This happens at two micro-batch sizes, `lo` and `hi`; every
figure at another size is the line through those two (seconds = a + c * samples: a fixed
cost per call plus a cost per sample), clamped at zero slope where noise made the larger
size faster. Precisions are measured once for the whole model, as factors on the fp32
figures (on a CPU, autocast to bf16 is often *slower*: it is measured, not assumed).

The result is cached as JSON under $XDG_CACHE_HOME/plait/profiles/ (~/.cache by default),
keyed by the model, the two sizes, the optimizer, torch's version, the host name and its
CPU count: a second `plait plan` on the same machine measures nothing.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plait.train.workload import Workload

REPEATS = 5
VERSION = 3  # of the cached JSON's meaning: a profile of another version is measured again
# (3: `repeated` only where --activation-checkpointing accepts the model: blocks, not layers)
Line = tuple[float, float]  # (a, c): a + c * samples


def _line(lo: int, y_lo: float, hi: int, y_hi: float) -> Line:
    """The line through (lo, y_lo) and (hi, y_hi), its slope and intercept at least 0."""
    if hi == lo:
        return (0.0, y_hi / hi)
    c = max(0.0, (y_hi - y_lo) / (hi - lo))
    return (max(0.0, y_hi - c * hi), c)


def at(line: Line, samples: float) -> float:
    return line[0] + line[1] * samples


@dataclass
class LayerCost:
    """One layer's figures as lines in the micro-batch size (see the module docstring)."""

    name: str
    forward: Line  # seconds
    backward: Line  # seconds (both gradients)
    saved: Line  # bytes autograd keeps from forward to backward
    params: int  # parameters (elements; fp32, so 4 bytes each)
    input_bytes: float  # per sample: what a checkpointed layer keeps instead of `saved`
    output_bytes: float  # per sample: a pipeline send, a tensor-parallel allreduce
    repeated: bool = False  # one of the blocks --activation-checkpointing wraps
    tp_allreduces: int = 0  # Megatron allreduces in its forward when split over tp (0: not)
    tp_units: int = 0  # gcd of its attention heads and MLP widths: a tp must divide it


@dataclass
class Profile:
    """A model's layers, its optimizer's step cost and its precisions' factors."""

    model: str
    layers: list[LayerCost]
    optimizer: str
    step_per_param: float  # optimizer seconds per parameter
    precisions: dict[str, tuple[float, float]] = field(default_factory=dict)
    # precision -> (time factor, saved-bytes factor) on fp32's; a missing one cannot run here

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        layers = []
        for layer in data.pop("layers"):
            fields: dict[str, Any] = {
                k: tuple(v) if isinstance(v, list) else v for k, v in layer.items()
            }  # JSON's lists back to the lines' tuples
            layers.append(LayerCost(**fields))
        precisions = {k: (v[0], v[1]) for k, v in data.pop("precisions").items()}
        return cls(layers=layers, precisions=precisions, **data)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "profiles"


def cache_path(model: str, lo: int, hi: int, optimizer: str) -> Path:
    import torch

    machine = f"{platform.node()}-c{os.cpu_count()}"
    key = f"v{VERSION}-{model}-b{lo}-{hi}-{optimizer}-torch{torch.__version__}-{machine}"
    return cache_dir() / (re.sub(r"[^\w.-]+", "_", key) + ".json")


def cached(workload: Workload, lo: int, hi: int, optimizer: str) -> Profile:
    """The profile of `workload` at micro-batches `lo` and `hi`: from the cache, or measured
    now and cached."""
    path = cache_path(workload.name, lo, hi, optimizer)
    try:
        return Profile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        pass
    found = measure(workload, lo, hi, optimizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(found.to_json())
    os.replace(tmp, path)
    return found


def _median_s(run: Any) -> float:
    run()  # warm-up: first calls allocate and dispatch slowly
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    # the least disturbed run: other processes on a shared machine only ever add time
    return min(times)


def _bytes(t: torch.Tensor) -> int:
    return t.nelement() * t.element_size()


def _time_layers(
    workload: Workload, layers: list[nn.Module], samples: int
) -> list[tuple[float, float, float, float, float]]:
    """(forward s, backward s, saved bytes, input bytes, output bytes) of every layer on a
    micro-batch of `samples`."""
    import torch

    from plait.saved_tensors import counting

    x, target = workload.data.train_batch(torch.arange(samples) % workload.data.num_train)
    found = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        params = [p for p in layer.parameters() if p.requires_grad]

        def forward(x: torch.Tensor = x, layer: nn.Module = layer, last: bool = last) -> Any:
            xi = x.detach().requires_grad_(x.is_floating_point())
            # a copy of the input, as a layer of the model receives one (not a leaf)
            y = layer(xi.clone() if xi.requires_grad else xi)
            return xi, (workload.loss(y, target) if last else y), y

        def both(forward: Any = forward, params: list[Any] = params) -> None:
            xi, out, _ = forward()
            wrt = ([xi] if xi.requires_grad else []) + params
            if out.requires_grad and wrt:
                grad = None if out.dim() == 0 else torch.ones_like(out)
                torch.autograd.grad(out, wrt, grad, allow_unused=True)

        f = _median_s(forward)
        b = max(0.0, _median_s(both) - f)
        with counting() as kept:
            _, _, y = forward()
        found.append((f, b, float(kept.peak), float(_bytes(x)), float(_bytes(y))))
        x = y.detach()
    return found


def _tp_units(layer: nn.Module) -> int:
    """The gcd of the layer's attention heads and MLP hidden sizes (the checks of
    plait.tensor_parallel.parallelize: every tp rank holds whole heads, equal slices)."""
    found = 0
    for m in layer.modules():
        q, fc, width = getattr(m, "q", None), getattr(m, "fc", None), getattr(m, "head_dim", 0)
        if all(hasattr(m, a) for a in ("k", "v", "out")) and q is not None and width:
            found = math.gcd(found, int(q.out_features) // int(width))
        elif hasattr(m, "proj") and fc is not None:
            found = math.gcd(found, int(fc.out_features))
    return found


def _tp_allreduces(layer: nn.Module) -> int:
    """Megatron allreduces of `layer`'s forward once split over tp: one per attention
    (q, k, v, out) and one per MLP (fc, proj), as plait.tensor_parallel.parallelize finds them."""
    return sum(
        1
        for m in layer.modules()
        if all(hasattr(m, a) for a in ("q", "k", "v", "out"))
        or all(hasattr(m, a) for a in ("fc", "proj"))
    )


def _precision_factors(
    workload: Workload, model: nn.Module, samples: int
) -> dict[str, tuple[float, float]]:
    """Per precision: the whole model's forward + backward time and saved bytes over fp32's."""
    import torch

    from plait.saved_tensors import counting
    from plait.train.parts_compute import PRECISIONS

    x, target = workload.data.train_batch(torch.arange(samples) % workload.data.num_train)
    figures: dict[str, tuple[float, float]] = {}
    for name, dtype in PRECISIONS.items():
        enabled = name != "fp32"

        def run(dtype: str = dtype, enabled: bool = enabled) -> float:
            cast = torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=enabled)
            with counting() as kept, cast:
                loss = workload.loss(model(x), target)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return float(kept.peak)

        try:
            seconds = _median_s(run)
            figures[name] = (seconds, run())
        except RuntimeError:  # this torch cannot autocast to it on the CPU: not a candidate
            continue
    base = figures["fp32"]
    return {n: (t / base[0], s / max(base[1], 1.0)) for n, (t, s) in figures.items()}


def measure(workload: Workload, lo: int, hi: int, optimizer: str) -> Profile:
    """Profile `workload` now (on one thread; see the module docstring)."""
    import torch

    from plait.activations import blocks_worth_checkpointing
    from plait.train.workload import stages

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = workload.build_model(0)
        layers = stages(model)
        try:
            blocks = [m for _, m in blocks_worth_checkpointing(model)]
        except ValueError:  # --activation-checkpointing refuses this model: never proposed
            blocks = []
        small = _time_layers(workload, layers, lo)
        large = _time_layers(workload, layers, hi)
        costs = []
        for i, layer in enumerate(layers):
            s, g = small[i], large[i]
            inside = {id(m) for m in layer.modules()}
            costs.append(
                LayerCost(
                    name=f"{i}:{type(layer).__name__}",
                    forward=_line(lo, s[0], hi, g[0]),
                    backward=_line(lo, s[1], hi, g[1]),
                    saved=_line(lo, s[2], hi, g[2]),
                    params=sum(p.numel() for p in layer.parameters()),
                    input_bytes=g[3] / hi,
                    output_bytes=g[4] / hi,
                    repeated=any(id(b) in inside for b in blocks),
                    tp_allreduces=_tp_allreduces(layer),
                    tp_units=_tp_units(layer),
                )
            )
        # at a middling size: bf16 on a CPU can be ten times slower than fp32
        precisions = _precision_factors(workload, model, min(hi, max(lo, 8)))
        step_per_param = _optimizer_cost(model, optimizer)
    finally:
        torch.set_num_threads(threads)
    return Profile(workload.name, costs, optimizer, step_per_param, precisions)


def _optimizer_cost(model: nn.Module, optimizer: str) -> float:
    """Seconds per parameter of one optimizer step (lars and lamb timed as adamw: the
    same passes over the state, plus norms)."""
    import torch

    from plait.train.optimizers import MAKERS

    maker = MAKERS["adamw" if optimizer in ("lars", "lamb") else optimizer]
    opt = maker(model.parameters(), 1e-3, 0.0, None)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    seconds = _median_s(opt.step)
    model.zero_grad(set_to_none=True)
    return seconds / max(1, sum(p.numel() for p in model.parameters()))

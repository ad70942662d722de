"""Each layer's cost, measured once per model and machine: forward and backward seconds,
parameters, and the bytes autograd keeps, as lines in the micro-batch size.

A layer is a pipeline layer (`GPT.layers()`, an `nn.Sequential`'s children:
`plait.train.workload.stages`), the unit a pipeline stage is cut from. Each is timed on
the output of the one before, on one thread (as a worker runs: OMP_NUM_THREADS=1), in
that thread's CPU time (time the scheduler gave others is not counted), the fastest of
`REPEATS` runs after one warm-up (others' load only adds), the last layer with the
workload's loss, under the allocator settings the workers run with (plait.allocator.kept:
no mmap, no trim). This happens at two micro-batch sizes, `lo` and `hi`; every
figure at another size is the line through those two (seconds = a + c * samples: a fixed
cost per call plus a cost per sample), clamped at zero slope where noise made the larger
size faster. Every layer is measured so under each precision that runs here too (bf16 and
fp16 under `torch.autocast`, as `plait train --precision` wraps its model: forward in the
low precision, backward outside autocast, outputs handed on as fp32), giving it lines of
its own per precision: autocast's gain or loss differs by layer kind and by size (on a CPU
bf16 matmuls can be several times *slower* than fp32, an embedding barely changes), so one
factor for the whole model at one size misjudged bf16/fp16 plans by up to 2x. `layer_cost`
is what the simulator reads. A zero-bubble schedule's B and W are timed too, each in its own
autograd pass as pipeline/split.py runs them (`LayerCost.halves`, fp32): inside a layer both
walk its chain of activations, so together they cost more than one backward. The timing
itself (the probes, the clock) is probes.py's.

With `device="cuda"` the layers run on the GPU (`plait plan --device cuda`): timed with a
`torch.cuda.synchronize()` before the clock stops, autocast "cuda", the optimizer's step on
the GPU. The saved bytes are counted as on the CPU (autograd's saved tensors).

The result is cached as JSON under $XDG_CACHE_HOME/plait/profiles/ (~/.cache by default),
keyed by the model, the two sizes, the optimizer, torch's version, the host name, its CPU
count and the device: a second `plait plan` on the same machine measures nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plait.train.workload import Workload

REPEATS = 5
VERSION = 6  # of the cached JSON's meaning: a profile of another version is measured again
# (3: `repeated` only where --activation-checkpointing accepts the model: blocks, not layers;
# 4: lines per layer for each precision, `LayerCost.by_precision`; 5: zero-bubble's B and W
# halves, `LayerCost.halves`; 6: the optimizer with the recipe's weight decay, and every
# figure under the workers' allocator)
Line = tuple[float, float]  # (a, c): a + c * samples
Lines = tuple[Line, Line, Line]  # forward seconds, backward seconds, saved bytes
MIDDLE = 8  # samples at which the whole model's factors (`Profile.precisions`) are read


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
    # precision (not fp32: the fields above) -> its (forward, backward, saved) measured under
    # that precision's autocast; one missing: fp32's lines times `Profile.precisions`' factors
    by_precision: dict[str, Lines] = field(default_factory=dict)
    # fp32's zero-bubble halves (B: the input's gradient, W: the weights'), each its own
    # autograd pass as pipeline/split.py runs them; None: half the backward each
    halves: tuple[Line, Line] | None = None


@dataclass
class Profile:
    """A model's layers, its optimizer's step cost and its precisions' factors."""

    model: str
    layers: list[LayerCost]
    optimizer: str
    step_per_param: float  # optimizer seconds per parameter
    precisions: dict[str, tuple[float, float]] = field(default_factory=dict)
    # precision -> (time factor, saved-bytes factor) on fp32's, the whole model's at MIDDLE
    # samples (a summary: the simulator reads each layer's own lines, `layer_cost`); a
    # missing one cannot run here
    device: str = "cpu"  # where it was measured: cpu or cuda

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
            if fields.get("halves") is not None:
                fields["halves"] = (tuple(fields["halves"][0]), tuple(fields["halves"][1]))
            fields["by_precision"] = {
                name: (tuple(f), tuple(b), tuple(s))
                for name, (f, b, s) in fields.get("by_precision", {}).items()
            }
            layers.append(LayerCost(**fields))
        precisions = {k: (v[0], v[1]) for k, v in data.pop("precisions").items()}
        return cls(layers=layers, precisions=precisions, **data)


def layer_cost(
    profile: Profile, layer: LayerCost, precision: str, micro: float
) -> tuple[float, float, float]:
    """(forward s, backward s, saved bytes) of `layer` on a micro-batch of `micro` samples in
    `precision`: its own lines for that precision where measured, else fp32's times the
    profile's whole-model factors (a made-up profile; fp32 itself: factors of exactly 1)."""
    lines = layer.by_precision.get(precision)
    if lines is not None:
        return at(lines[0], micro), at(lines[1], micro), at(lines[2], micro)
    tfac, afac = profile.precisions[precision]
    return (
        at(layer.forward, micro) * tfac,
        at(layer.backward, micro) * tfac,
        at(layer.saved, micro) * afac,
    )


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "profiles"


def cache_path(model: str, lo: int, hi: int, optimizer: str, device: str = "cpu") -> Path:
    import torch

    machine = f"{platform.node()}-c{os.cpu_count()}-{device}"
    if device == "cuda":  # which GPU: a profile of one does not price another
        machine += "-" + torch.cuda.get_device_name()
    key = f"v{VERSION}-{model}-b{lo}-{hi}-{optimizer}-torch{torch.__version__}-{machine}"
    return cache_dir() / (re.sub(r"[^\w.-]+", "_", key) + ".json")


def cached(workload: Workload, lo: int, hi: int, optimizer: str, device: str = "cpu") -> Profile:
    """The profile of `workload` at micro-batches `lo` and `hi` on `device` (cpu or cuda):
    from the cache, or measured now and cached."""
    path = cache_path(workload.name, lo, hi, optimizer, device)
    try:
        return Profile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        pass
    found = measure(workload, lo, hi, optimizer, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(found.to_json())
    os.replace(tmp, path)
    return found


def _factors(
    layers: list[LayerCost], by_precision: list[dict[str, Lines]]
) -> dict[str, tuple[float, float]]:
    """Per precision: the whole model's forward + backward time and saved bytes over fp32's
    at MIDDLE samples, from the layers' lines (a summary for the reader)."""
    fp32 = [(lc.forward, lc.backward, lc.saved) for lc in layers]

    def totals(lines: list[Lines]) -> tuple[float, float]:
        return (
            sum(at(f, MIDDLE) + at(b, MIDDLE) for f, b, _ in lines),
            sum(at(s, MIDDLE) for _, _, s in lines),
        )

    t0, s0 = totals(fp32)
    found = {"fp32": (1.0, 1.0)}
    for name in by_precision[0] if by_precision else {}:
        t, s = totals([own[name] for own in by_precision])
        found[name] = (t / max(t0, 1e-12), s / max(s0, 1.0))
    return found


def measure(workload: Workload, lo: int, hi: int, optimizer: str, device: str = "cpu") -> Profile:
    """Profile `workload` now on `device` (cpu: on one thread; see the module docstring).

    Raises:
        DeviceError: cuda asked for where no GPU is visible.
    """
    import torch

    from plait import devices
    from plait.activations import blocks_worth_checkpointing
    from plait.allocator import kept as workers_allocator
    from plait.plan.probes import Probe, fastest_s, probes
    from plait.tensor_parallel.parallelize import allreduces, units
    from plait.train.parts_compute import PRECISIONS
    from plait.train.workload import stages

    where = devices.resolve(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # exact fp32 matmuls and convolutions, as `plait train` runs on CUDA without --tf32
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    # the allocator as the workers have it (plait.allocator: a freed block kept, so that a
    # timing pays no page fault a worker never sees: sgd's step over wide 15 ms, not 8)
    kept = contextlib.ExitStack()
    kept.enter_context(workers_allocator())
    try:
        model = workload.build_model(0).to(where)
        layers = stages(model)
        try:
            blocks = [m for _, m in blocks_worth_checkpointing(model)]
        except ValueError:  # --activation-checkpointing refuses this model: never proposed
            blocks = []
        # (precision, samples) -> its layers' probed: fp32, then the others where they run
        probed: dict[tuple[str, int], list[Probe]] = {}
        for name in PRECISIONS:
            try:
                both = {(name, n): probes(workload, layers, n, name, where) for n in (lo, hi)}
            except RuntimeError:  # this torch cannot autocast to it here: not a candidate
                continue
            probed.update(both)
        order = [(key, i) for key, found in probed.items() for i in range(len(found))]
        runs = [r for key, i in order for r in (probed[key][i].forward, probed[key][i].both)]
        halves = [(n, i) for n in (lo, hi) for i in range(len(layers))]  # fp32's B and W
        runs += [
            r
            for n, i in halves
            for r in (probed[("fp32", n)][i].inputs_only, probed[("fp32", n)][i].weights_only)
        ]
        seconds = fastest_s(runs, where, REPEATS)
        split_s = seconds[2 * len(order) :]
        seconds = seconds[: 2 * len(order)]
        # (precision, samples, layer) -> (forward s, backward s, saved bytes)
        figures = {
            (*key, i): (f, max(0.0, fb - f), probed[key][i].saved)
            for (key, i), f, fb in zip(order, seconds[0::2], seconds[1::2], strict=True)
        }
        names = sorted({name for name, _ in probed}, key=list(PRECISIONS).index)
        # (samples, layer) -> (B s, W s): each half's pass less the forward
        halved = {
            (n, i): (
                max(0.0, b - figures[("fp32", n, i)][0]),
                max(0.0, w - figures[("fp32", n, i)][0]),
            )
            for (n, i), b, w in zip(halves, split_s[0::2], split_s[1::2], strict=True)
        }

        def lines(name: str, i: int) -> Lines:
            s, g = figures[(name, lo, i)], figures[(name, hi, i)]
            return _line(lo, s[0], hi, g[0]), _line(lo, s[1], hi, g[1]), _line(lo, s[2], hi, g[2])

        costs, own = [], []
        for i, layer in enumerate(layers):
            g = probed[("fp32", hi)][i]
            forward, backward, saved = lines("fp32", i)
            inside = {id(m) for m in layer.modules()}
            own.append({name: lines(name, i) for name in names if name != "fp32"})
            costs.append(
                LayerCost(
                    name=f"{i}:{type(layer).__name__}",
                    forward=forward,
                    backward=backward,
                    saved=saved,
                    params=sum(p.numel() for p in layer.parameters()),
                    input_bytes=g.input_bytes / hi,
                    output_bytes=g.output_bytes / hi,
                    repeated=any(id(b) in inside for b in blocks),
                    tp_allreduces=allreduces(layer),
                    tp_units=units(layer),
                    by_precision=own[-1],
                    halves=(
                        _line(lo, halved[(lo, i)][0], hi, halved[(hi, i)][0]),
                        _line(lo, halved[(lo, i)][1], hi, halved[(hi, i)][1]),
                    ),
                )
            )
        step_per_param = _optimizer_cost(
            model, optimizer, where, _weight_decay(workload, optimizer)
        )
    finally:
        kept.close()
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return Profile(workload.name, costs, optimizer, step_per_param, _factors(costs, own), device)


def _weight_decay(workload: Workload, optimizer: str) -> float:
    """The weight decay `plait train` gives `optimizer` on this workload (its recipe's)."""
    from plait.train.recipes import CUSTOM, RECIPES

    rates = RECIPES.get(workload.name, CUSTOM).rates
    return rates[optimizer].weight_decay if optimizer in rates else 0.0


def _optimizer_cost(
    model: nn.Module, optimizer: str, device: torch.device, weight_decay: float
) -> float:
    """Seconds per parameter of one optimizer step on `device`, configured as `plait train`
    configures it (its momentum, Nesterov, the recipe's `weight_decay`: sgd's adds a pass
    and a temporary per parameter; lars and lamb timed as adamw: the same passes over the
    state, plus norms)."""
    import torch

    from plait.train.optimizers import MAKERS

    maker = MAKERS["adamw" if optimizer in ("lars", "lamb") else optimizer]
    opt = maker(model.parameters(), 1e-3, weight_decay, None)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    from plait.plan.probes import fastest_s

    (seconds,) = fastest_s([opt.step], device, REPEATS)
    model.zero_grad(set_to_none=True)
    return seconds / max(1, sum(p.numel() for p in model.parameters()))

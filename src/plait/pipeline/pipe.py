"""The pipeline runtime: run one stage of a sequential model under a schedule.

`Pipeline` cuts an `nn.Sequential` (or a list of modules) into `p` contiguous stages, one
per rank of the pipeline communicator, keeps this rank's stage, and runs the actions that
`SCHEDULES[schedule](p, chunks)` lists for it: forwards receive activations from the
previous stage, backwards receive output gradients from the next one. Activations and
gradients travel with a small shape header (see `plait.pipeline.p2p`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.frames import Request
from plait.comm.mesh import Mesh
from plait.pipeline.balance import balance as balance_costs
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.schedule import SCHEDULES, Action, ScheduleError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Accumulate = Callable[[], contextlib.AbstractContextManager[Any]]

CHECKPOINTS = ("never", "except_last", "always")
BALANCE_BY = ("size", "time")


def size_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Per-layer cost for `balance="size"`: the bytes of the layer's parameters."""
    return [float(sum(p.numel() * p.element_size() for p in m.parameters())) for m in layers]


def time_costs(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Per-layer cost for `balance="time"`: median seconds of forward + backward of each layer
    on `sample` (one micro-batch), the layers run in order so each sees its real input.

    Gradients are taken with `torch.autograd.grad`, so no parameter's `.grad` is touched.
    """
    costs: list[float] = []
    x = sample.detach()
    for layer in layers:
        params = [p for p in layer.parameters() if p.requires_grad]
        runs: list[float] = []
        y = x
        for _ in range(repeats):
            xi = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(xi)
            if y.requires_grad:
                wrt = ([xi] if xi.requires_grad else []) + params
                torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
            runs.append(time.perf_counter() - start)
        costs.append(sorted(runs)[len(runs) // 2])
        x = y.detach()
    return costs


def split_sizes(layers: int, stages: int, balance: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: `balance` checked, or as even as possible (earlier stages get more)."""
    if balance is None:
        if layers < stages:
            raise ValueError(f"cannot split {layers} layers into {stages} non-empty stages")
        q, r = divmod(layers, stages)
        return [q + (1 if i < r else 0) for i in range(stages)]
    sizes = list(balance)
    if len(sizes) != stages:
        raise ValueError(
            f"balance {sizes} has {len(sizes)} entries but the pipeline has {stages} stages"
        )
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"balance {sizes} must hold positive layer counts")
    if sum(sizes) != layers:
        eq = " + ".join(str(s) for s in sizes)
        raise ValueError(
            f"balance {sizes} does not cover the model: {eq} = {sum(sizes)} != {layers} layers"
        )
    return sizes


class _Saved:
    """A packed saved tensor; counts itself live until autograd frees it."""

    __slots__ = ("nbytes", "stats", "tensor")

    def __init__(self, tensor: torch.Tensor, stats: PipeStats) -> None:
        self.tensor = tensor
        self.stats = stats
        self.nbytes = tensor.numel() * tensor.element_size()
        stats.saved_live += self.nbytes
        stats.saved_packs += 1
        stats.peak_saved_bytes = max(stats.peak_saved_bytes, stats.saved_live)

    def __del__(self) -> None:
        self.stats.saved_live -= self.nbytes


@dataclass
class PipeStats:
    """What one `Pipeline.step` measured on this stage.

    times: per action, (start, end) of its compute in seconds from the step's start
        (receives before and sends after are not inside).
    step_time: the step's wall time; compute_time: the sum of this stage's F and B compute.
    bubble: (step_time - compute_time) / step_time, the idle fraction of this stage.
    peak_inflight: most micro-batches forwarded whose backward had not run yet.
    peak_saved_bytes / saved_packs: from saved-tensor hooks, the peak bytes autograd held
        for this stage's graphs and how many tensors it saved; mb_saved_bytes: the bytes
        saved by each micro-batch's forward, so the peak divided by them cross-checks
        peak_inflight.
    """

    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    step_time: float = 0.0
    compute_time: float = 0.0
    bubble: float = 0.0
    peak_inflight: int = 0
    peak_saved_bytes: int = 0
    saved_packs: int = 0
    saved_live: int = 0
    mb_saved_bytes: list[int] = field(default_factory=list)


class Pipeline:
    """One rank's stage of a pipelined sequential model.

    Args:
        module: the whole model, as an `nn.Sequential` or list of layers (every rank passes
            the same one; each keeps only its own slice as `self.stage`).
        comm: the pipeline communicator, or a `Mesh` (its `pp` axis is used).
        chunks: micro-batches per step.
        schedule: a key of `SCHEDULES` ("gpipe" or "1f1b").
        balance: layers per stage as a list; or "size" (split by each layer's parameter
            bytes) or "time" (split by each layer's profiled forward + backward time on
            `sample`), both through `plait.pipeline.balance`; default as even as possible.
            "time" profiles on rank 0 only and broadcasts the split, so every rank agrees.
        checkpoint: re-materialisation (GPipe; torchgpipe's names). "never" keeps every
            micro-batch's activations until its backward; "always" runs each forward
            under `torch.no_grad`, keeping only the stage's input, and re-runs it with grad
            enabled (same RNG state) right before the backward; "except_last" checkpoints
            every micro-batch but the last.
        sample: one micro-batch of the model's input, needed (on rank 0) by balance="time".

    `self.stage` is the module the schedule runs; it may be replaced by a wrapper of itself
    before the first step, e.g. `DataParallel(pipe.stage, comm=mesh.dp)` to average the
    stage's gradients over data-parallel replicas (see `step`'s `accumulate`).
    """

    def __init__(
        self,
        module: nn.Sequential | list[nn.Module],
        comm: Communicator | Mesh,
        chunks: int,
        schedule: str = "1f1b",
        balance: list[int] | str | None = None,
        checkpoint: str = "never",
        sample: torch.Tensor | None = None,
    ) -> None:
        self.comm = comm.pp if isinstance(comm, Mesh) else comm
        self.stages = self.comm.size
        self.rank = self.comm.rank
        if schedule not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        if checkpoint not in CHECKPOINTS:
            raise ValueError(
                f"unknown checkpoint {checkpoint!r}; expected one of {list(CHECKPOINTS)}"
            )
        self.chunks = chunks
        self.schedule = schedule
        self.checkpoint = checkpoint
        self.actions = SCHEDULES[schedule](self.stages, chunks)[self.rank]
        layers = list(module)
        if isinstance(balance, str):
            balance = self._balance_by(balance, layers, sample)
        self.balance = split_sizes(len(layers), self.stages, balance)
        start = sum(self.balance[: self.rank])
        self.stage: nn.Module = nn.Sequential(*layers[start : start + self.balance[self.rank]])
        self.first = self.rank == 0
        self.last = self.rank == self.stages - 1
        # the position of this stage's final backward: the one that may reduce gradients
        self.final_backward = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        self.stats = PipeStats()

    def _balance_by(
        self, how: str, layers: list[nn.Module], sample: torch.Tensor | None
    ) -> list[int]:
        if how not in BALANCE_BY:
            raise ValueError(
                f"unknown balance {how!r}; expected a list of layer counts or one of "
                f"{list(BALANCE_BY)}"
            )
        if len(layers) < self.stages:
            raise ValueError(f"cannot split {len(layers)} layers into {self.stages} stages")
        if how == "size":
            return balance_costs(size_costs(layers), self.stages)
        sizes: list[int] | None = None
        if self.rank == 0:
            if sample is None:
                raise ValueError(
                    'balance="time" needs sample= (one micro-batch of the input) on rank 0'
                )
            sizes = balance_costs(time_costs(layers, sample), self.stages)
        if self.stages == 1:
            return sizes if sizes is not None else [len(layers)]
        got: list[int] = self.comm.broadcast_object(sizes, root=0)
        return got

    def _checkpointed(self, mb: int) -> bool:
        if self.checkpoint == "always":
            return True
        return self.checkpoint == "except_last" and mb < self.chunks - 1

    def _tag(self, kind: str, mb: int) -> int:
        return (0 if kind == "F" else 1) * self.chunks + mb

    def step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: LossFn,
        accumulate: Accumulate | None = None,
    ) -> torch.Tensor | None:
        """Run one forward and backward of the mini-batch; return the mean loss on the last
        stage, None elsewhere. Gradients accumulate in the stage's parameters' `.grad`.

        Each micro-batch's loss is weighted by its share of the batch (1 / chunks when the
        batch divides evenly), so for a mean-reduced loss the gradients equal the full-batch
        ones. `inputs` is needed on the first stage, `targets` on the last.

        accumulate: a context-manager factory (e.g. a DataParallel stage's `no_sync`) that
            every backward but this stage's final one runs inside, so that gradients are
            reduced once per step, overlapped with the final backward.
        """
        x_mbs = self._split(inputs, "inputs") if self.first else None
        t_mbs = self._split(targets, "targets") if self.last else None
        batch = sum(len(t) for t in t_mbs) if t_mbs is not None else 0
        stats = PipeStats()
        self.stats = stats
        ins: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        kept: dict[int, _Saved] = {}  # checkpointed micro-batches: the input, counted
        rng: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        pending: list[Request] = []
        total = None
        inflight = 0

        def pack(t: torch.Tensor) -> Any:
            return _Saved(t, stats)

        def unpack(s: Any) -> torch.Tensor:
            return s.tensor

        t0 = time.perf_counter()
        for i, act in enumerate(self.actions):
            mb = act.mb
            if act.kind == "F":
                if x_mbs is not None:
                    x = x_mbs[mb]
                else:
                    x = recv_tensor(self.comm, self.rank - 1, self._tag("F", mb))
                    if x.is_floating_point():
                        x.requires_grad_()
                start = time.perf_counter()
                before = stats.saved_live
                if self._checkpointed(mb):
                    rng[mb] = torch.get_rng_state()
                    with torch.no_grad():
                        y = self.stage(x)
                    kept[mb] = _Saved(x, stats)
                else:
                    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                        y = self.stage(x)
                        if t_mbs is not None:
                            t = t_mbs[mb]
                            losses[mb] = loss_fn(y, t) * (len(t) / batch)
                    outs[mb] = y
                stats.mb_saved_bytes.append(stats.saved_live - before)
                end = time.perf_counter()
                ins[mb] = x
                inflight += 1
                stats.peak_inflight = max(stats.peak_inflight, inflight)
                if not self.last:
                    pending += send_tensor(self.comm, y, self.rank + 1, self._tag("F", mb))
            else:
                if self.last:
                    grad = None
                else:
                    grad = recv_tensor(self.comm, self.rank + 1, self._tag("B", mb))
                start = time.perf_counter()
                x = ins.pop(mb)
                if mb in kept:
                    # re-materialise: the input's bytes are autograd's again from here
                    del kept[mb]
                    with torch.random.fork_rng(devices=[]):
                        torch.set_rng_state(rng.pop(mb))
                        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                            y = self.stage(x)
                            if t_mbs is not None:
                                t = t_mbs[mb]
                                losses[mb] = loss_fn(y, t) * (len(t) / batch)
                else:
                    y = outs.pop(mb)
                hold = contextlib.nullcontext
                if accumulate is not None and i != self.final_backward:
                    hold = accumulate  # type: ignore[assignment]
                with hold():
                    if self.last:
                        loss = losses.pop(mb)
                        loss.backward()
                        total = loss.detach() if total is None else total + loss.detach()
                    elif y.requires_grad:
                        torch.autograd.backward(y, grad)
                end = time.perf_counter()
                del y
                inflight -= 1
                if not self.first:
                    gx = x.grad if x.grad is not None else torch.zeros_like(x)
                    pending += send_tensor(self.comm, gx, self.rank - 1, self._tag("B", mb))
                del x
            stats.times[act] = (start - t0, end - t0)
            stats.compute_time += end - start
        for req in pending:
            req.wait()
        stats.step_time = time.perf_counter() - t0
        idle = max(stats.step_time - stats.compute_time, 0.0)
        stats.bubble = idle / stats.step_time if stats.step_time > 0 else 0.0
        return total

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only, in one piece (no micro-batches; for evaluation): the model's output
        on the last stage, None elsewhere. `inputs` is needed on the first stage."""
        if self.first:
            if inputs is None:
                raise ValueError("stage 0 needs inputs (got None)")
            x = inputs
        else:
            x = recv_tensor(self.comm, self.rank - 1, self._tag("F", 0))
        y = self.stage(x)
        if self.last:
            return y
        for req in send_tensor(self.comm, y, self.rank + 1, self._tag("F", 0)):
            req.wait()
        return None

    def _split(self, t: torch.Tensor | None, name: str) -> list[torch.Tensor]:
        if t is None:
            raise ValueError(f"stage {self.rank} needs {name} (got None)")
        if t.dim() == 0 or len(t) < self.chunks:
            n = 0 if t.dim() == 0 else len(t)
            raise ValueError(f"{name} has batch size {n}, fewer than chunks={self.chunks}")
        return list(torch.chunk(t, self.chunks))

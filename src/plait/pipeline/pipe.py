"""The pipeline runtime: run one stage of a sequential model under a schedule.

`Pipeline` cuts an `nn.Sequential` (or a list of modules) into `p` contiguous stages, one
per rank of the pipeline communicator, keeps this rank's stage, and runs the actions that
`SCHEDULES[schedule](p, chunks)` lists for it: forwards receive activations from the
previous stage, backwards receive output gradients from the next one. Activations and
gradients travel with a small shape header (see `plait.pipeline.p2p`). How the layers are
split is balance.py's; what a step measures is stats.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait import devices
from plait.comm.communicator import Communicator
from plait.comm.mesh import Mesh
from plait.comm.request import Request
from plait.pipeline.balance import stage_sizes
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.schedule import SCHEDULES, ScheduleError
from plait.pipeline.stats import PipeStats, Saved
from plait.trace.recorder import Recorder

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Accumulate = Callable[[], contextlib.AbstractContextManager[Any]]

CHECKPOINTS = ("never", "except_last", "always")


@dataclass
class _StepState:
    """What one `Pipeline.step` carries from action to action (keyed by micro-batch)."""

    x_mbs: list[torch.Tensor] | None  # first stage: the input micro-batches
    t_mbs: list[torch.Tensor] | None  # last stage: the target micro-batches
    loss_fn: LossFn
    accumulate: Accumulate | None
    stats: PipeStats
    batch: int = 0  # the last stage's batch size: each micro-batch's loss weight is len / batch
    ins: dict[int, torch.Tensor] = field(default_factory=dict)  # stage inputs, for backward
    outs: dict[int, torch.Tensor] = field(default_factory=dict)  # stage outputs, ditto
    kept: dict[int, Saved] = field(default_factory=dict)  # checkpointed: the input, counted
    # checkpointed micro-batches: the RNG states (CPU, and the stage's GPU) at their forward
    rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: list[Request] = field(default_factory=list)  # sends, waited for at the end
    total: torch.Tensor | None = None  # the last stage's loss so far
    inflight: int = 0  # micro-batches forwarded whose backward has not run
    rec: Recorder | None = None  # plait.trace's, while a trace records


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
        self.balance = stage_sizes(balance, layers, self.comm, sample)
        start = sum(self.balance[: self.rank])
        self.stage: nn.Module = nn.Sequential(*layers[start : start + self.balance[self.rank]])
        self.first = self.rank == 0
        self.last = self.rank == self.stages - 1
        # the position of this stage's final backward: the one that may reduce gradients
        self.final_backward = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        self.stats = PipeStats()
        if self.stages > 1:  # every stage is here: connect the NCCL lanes its activations
            self.comm.connect_lanes()  # travel on (on GPUs)

    @property
    def device(self) -> torch.device:
        """Where this stage's parameters are (and its received activations go): the device
        of its first parameter or buffer, else the job's (plait.device())."""
        for t in itertools.chain(self.stage.parameters(), self.stage.buffers()):
            return t.device
        return devices.device()

    def _checkpointed(self, mb: int) -> bool:
        if self.checkpoint == "always":
            return True
        return self.checkpoint == "except_last" and mb < self.chunks - 1

    def _recv(self, peer: int, tag: int, rec: Recorder | None) -> torch.Tensor:
        """The activation or gradient from stage `peer`; while a trace records, the wait is
        a "recv" comm event (the stage idles there: the bubble's other side)."""
        if rec is None:
            return recv_tensor(self.comm, peer, tag, self.device)
        start = time.perf_counter()
        t = recv_tensor(self.comm, peer, tag, self.device)
        info = {"algorithm": "p2p", "bytes": t.numel() * t.element_size(),
                "group": self.comm.label, "peer": peer}  # fmt: skip
        rec.complete("comm", "recv", start, time.perf_counter(), info)
        return t

    def _send(self, t: torch.Tensor, peer: int, tag: int, run: _StepState) -> None:
        """Start sending `t` to stage `peer` (waited for at the end of the step); while a
        trace records, a "send" comm event spans the call: the time this stage spent
        issuing it (the transfer itself overlaps what follows: the receiver's "recv" shows
        when it arrived)."""
        rec = run.rec
        if rec is None:
            run.pending += send_tensor(self.comm, t, peer, tag)
            return
        start = time.perf_counter()
        run.pending += send_tensor(self.comm, t, peer, tag)
        info = {"algorithm": "p2p", "bytes": t.numel() * t.element_size(),
                "group": self.comm.label, "peer": peer}  # fmt: skip
        rec.complete("comm", "send", start, time.perf_counter(), info)

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
        run = _StepState(
            x_mbs=self._split(inputs, "inputs") if self.first else None,
            t_mbs=self._split(targets, "targets") if self.last else None,
            loss_fn=loss_fn,
            accumulate=accumulate,
            stats=PipeStats(),
            rec=getattr(self.comm, "recorder", None),  # (the tests' stand-in comms have none)
        )
        run.batch = sum(len(t) for t in run.t_mbs) if run.t_mbs is not None else 0
        self.stats = run.stats
        t0 = time.perf_counter()
        for i, act in enumerate(self.actions):
            if act.kind == "F":
                start, end = self._forward(act.mb, run)
            else:  # "B"
                start, end = self._backward(act.mb, run, final=i == self.final_backward)
            run.stats.record(act, start, end, t0)
            if run.rec is not None:  # plait.trace: one event per action
                run.rec.complete("pipeline", f"{act.kind}{act.mb}", start, end,
                             {"stage": self.rank, "mb": act.mb})  # fmt: skip
        for req in run.pending:
            req.wait()
        run.stats.finish(time.perf_counter() - t0)
        return run.total

    def _forward(self, mb: int, run: _StepState) -> tuple[float, float]:
        """Forward micro-batch `mb`: receive its input, run the stage, send the output on.

        Returns the (start, end) of its compute."""
        stats = run.stats
        if run.x_mbs is not None:
            x = run.x_mbs[mb]
        else:
            x = self._recv(self.rank - 1, self._tag("F", mb), run.rec)
            if x.is_floating_point():
                x.requires_grad_()
        start = time.perf_counter()
        before = stats.saved_live
        if self._checkpointed(mb):
            # keep only the input (counted) and the RNG state; backward runs it again
            run.rng[mb] = _rng_state(self.device)
            with torch.no_grad():
                y = self.stage(x)
            run.kept[mb] = Saved(x, stats)
        else:
            with stats.counting():
                y = self.stage(x)
                self._loss(mb, y, run)
            run.outs[mb] = y
        stats.mb_saved_bytes.append(stats.saved_live - before)
        end = time.perf_counter()
        run.ins[mb] = x
        run.inflight += 1
        stats.peak_inflight = max(stats.peak_inflight, run.inflight)
        if not self.last:
            self._send(y, self.rank + 1, self._tag("F", mb), run)
        return start, end

    def _backward(self, mb: int, run: _StepState, final: bool) -> tuple[float, float]:
        """Backward micro-batch `mb`: receive its output gradient, backpropagate through the
        stage, send the input gradient back. `final`: this stage's last backward of the step,
        the one run outside `accumulate` (it may reduce gradients).

        Returns the (start, end) of its compute."""
        grad = None if self.last else self._recv(self.rank + 1, self._tag("B", mb), run.rec)
        start = time.perf_counter()
        x = run.ins.pop(mb)
        if mb in run.kept:
            # re-materialise: the input's bytes are autograd's again from here
            del run.kept[mb]
            on_gpu = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=on_gpu):
                _set_rng_state(self.device, run.rng.pop(mb))
                with run.stats.counting():
                    y = self.stage(x)
                    self._loss(mb, y, run)
        else:
            y = run.outs.pop(mb)
        hold: Accumulate = contextlib.nullcontext
        if run.accumulate is not None and not final:
            hold = run.accumulate
        with hold():
            if self.last:
                loss = run.losses.pop(mb)
                loss.backward()
                run.total = loss.detach() if run.total is None else run.total + loss.detach()
            elif y.requires_grad:
                torch.autograd.backward(y, grad)
        end = time.perf_counter()
        del y
        run.inflight -= 1
        if not self.first:
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            self._send(gx, self.rank - 1, self._tag("B", mb), run)
        return start, end

    def _loss(self, mb: int, y: torch.Tensor, run: _StepState) -> None:
        """On the last stage: micro-batch mb's loss, weighted by its share of the batch."""
        if run.t_mbs is not None:
            t = run.t_mbs[mb]
            run.losses[mb] = run.loss_fn(y, t) * (len(t) / run.batch)

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only, in one piece (no micro-batches; for evaluation): the model's output
        on the last stage, None elsewhere. `inputs` is needed on the first stage."""
        if self.first:
            if inputs is None:
                raise ValueError("stage 0 needs inputs (got None)")
            x = inputs
        else:
            x = recv_tensor(self.comm, self.rank - 1, self._tag("F", 0), self.device)
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


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG states a re-run forward needs: the CPU's, and `device`'s if a GPU."""
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, gpu = state
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, device)

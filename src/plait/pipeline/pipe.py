"""The pipeline runtime: run one stage of a sequential model under a schedule.

`Pipeline` cuts an `nn.Sequential` (or a list of modules) into `p` contiguous stages, one
per rank of the pipeline communicator (with `virtual=v`, into p*v virtual stages, v per
rank: route.py), keeps this rank's, and runs the actions that `build(schedule, p, chunks,
v)` lists for it: forwards receive activations from the previous stage, backwards receive
output gradients from the next one, and with a zero-bubble schedule each backward is split
into B now and W later (split.py). Activations and gradients travel with a small shape
header (see `plait.pipeline.p2p`). How the layers are split is balance.py's; what a step
measures is stats.py's.
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
from plait.comm.core.request import Request
from plait.comm.mesh import Mesh
from plait.pipeline.balance import stage_sizes
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.route import Route, lanes_agree
from plait.pipeline.schedule import SCHEDULES, Action, ScheduleError, build
from plait.pipeline.split import Cutter, Piece, Pieces, input_grad, leaf, weight_grad
from plait.pipeline.stats import PipeStats, Saved
from plait.trace.recorder import Recorder

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Accumulate = Callable[[], contextlib.AbstractContextManager[Any]]

CHECKPOINTS = ("never", "except_last", "always")
Key = tuple[int, int]  # (micro-batch, part): what a stage holds between its actions


@dataclass
class _StepState:
    """What one `Pipeline.step` carries from action to action (keyed by (micro-batch, part))."""

    x_mbs: list[torch.Tensor] | None  # first stage: the input micro-batches
    t_mbs: list[torch.Tensor] | None  # last stage: the target micro-batches
    loss_fn: LossFn
    accumulate: Accumulate | None
    stats: PipeStats
    batch: int = 0  # the last stage's batch size: each micro-batch's loss weight is len / batch
    ins: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage inputs, for backward
    outs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage outputs, ditto
    kept: dict[Key, Saved] = field(default_factory=dict)  # checkpointed: the input, counted
    # checkpointed micro-batches: the RNG states (CPU, and the stage's GPU) at their forward
    rng: dict[Key, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    pieces: dict[Key, Pieces] = field(default_factory=dict)  # split backward: the cut graph
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: list[Request] = field(default_factory=list)  # sends, waited for at the end
    total: torch.Tensor | None = None  # the last stage's loss so far
    inflight: int = 0  # (micro-batch, part)s forwarded whose backward (W if split) has not run
    rec: Recorder | None = None  # plait.trace's, while a trace records


class Pipeline:
    """One rank's stage of a pipelined sequential model.

    Args:
        module: the whole model, as an `nn.Sequential` or list of layers (every rank passes
            the same one; each keeps only its own slice as `self.stage`).
        comm: the pipeline communicator, or a `Mesh` (its `pp` axis is used).
        chunks: micro-batches per step.
        schedule: one of `SCHEDULES`: "gpipe", "1f1b", "interleaved" (needs chunks a
            multiple of the stages) or "zb-h1" (checkpoint "never" only).
        virtual: with "interleaved", the parts each rank holds (v; Megatron's model chunks):
            the layers are cut into p*v virtual stages and part j of rank r is virtual stage
            j*p + r. `self.stage` is then a `Parts` (one `nn.Sequential` per part).
        balance: layers per stage as a list (per virtual stage when interleaved); or "size"
            (split by each layer's parameter bytes) or "time" (split by each layer's
            profiled forward + backward time on `sample`), both through
            `plait.pipeline.balance`; default as even as possible. "time" profiles on rank 0
            only and broadcasts the split, so every rank agrees.
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
        virtual: int = 1,
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
        if schedule == "interleaved" and self.stages < 2:
            raise ScheduleError(
                "interleaved needs at least 2 pipeline stages (with one, its parts would "
                "send to themselves); got 1"
            )
        schedules = build(schedule, self.stages, chunks, virtual)
        self.split = any(a.kind == "W" for a in schedules[self.rank])
        if self.split and checkpoint != "never":
            raise ValueError(
                f"schedule {schedule!r} splits each backward into B and W, which keeps the "
                f"graph between them; it takes checkpoint='never', got {checkpoint!r}"
            )
        self.chunks = chunks
        self.schedule = schedule
        self.parts = virtual
        self.route = Route(self.stages, virtual)
        self.checkpoint = checkpoint
        self.actions = schedules[self.rank]
        layers = list(module)
        # layers per stage (per virtual stage when interleaved), in model order
        self.balance = stage_sizes(balance, layers, self.comm, sample, self.route.virtual_stages)
        self.part_layers: list[list[nn.Module]] = []
        for part in range(virtual):
            v = self.route.virtual(self.rank, part)
            start = sum(self.balance[:v])
            self.part_layers.append(layers[start : start + self.balance[v]])
        self.stage: nn.Module = (
            nn.Sequential(*self.part_layers[0]) if virtual == 1
            else Parts(nn.Sequential(*ls) for ls in self.part_layers)
        )  # fmt: skip
        self.first = self.rank == 0  # the rank the inputs go to
        self.last = self.rank == self.stages - 1  # the rank the targets go to
        # the action that may reduce gradients: the last one that computes weight gradients
        # (W if split, else B); interleaved: none, a pass after the last one does (_sync)
        grads = "W" if self.split else "B"
        self.final = max(i for i, a in enumerate(self.actions) if a.kind == grads)
        if virtual > 1:
            self.final = -1
        self._cutter = Cutter([m for ls in self.part_layers for m in ls]) if self.split else None
        self.stats = PipeStats()
        if self.stages > 1:  # every stage is here: connect the NCCL lanes its activations
            self.comm.connect_lanes()  # travel on (on GPUs)
        if self.device.type == "cuda":  # NCCL matches messages by order: check it holds
            lanes_agree(schedules, self.route)

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

    def _tag(self, kind: str, mb: int, sender_part: int = 0) -> int:
        """The tag of micro-batch `mb`'s activation (F) or gradient (B) sent by a part
        `sender_part`: unique between any two ranks (with one part: kind * chunks + mb)."""
        return ((0 if kind == "F" else 1) * self.parts + sender_part) * self.chunks + mb

    def _call(self, x: torch.Tensor, part: int) -> torch.Tensor:
        y: torch.Tensor = self.stage(x) if self.parts == 1 else self.stage(x, part=part)
        return y

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
            reduced once per step, overlapped with the final backward (W if split). With
            parts (interleaved) the final backward holds one part's gradients only, so
            every backward runs inside it and a pass after them all reduces (`_sync`).
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
                start, end = self._forward(act, run)
            elif act.kind == "B":
                start, end = self._backward(act, run, final=i == self.final)
            else:  # "W"
                start, end = self._weight(act, run, final=i == self.final)
            run.stats.record(act, start, end, t0)
            if run.rec is not None:  # plait.trace: one event per action
                run.rec.complete("pipeline", act.label(self.parts > 1), start, end,
                             {"stage": self.rank, "mb": act.mb})  # fmt: skip
        if self.parts > 1 and accumulate is not None:
            self._sync()
        for req in run.pending:
            req.wait()
        run.stats.finish(time.perf_counter() - t0)
        return run.total

    def _forward(self, act: Action, run: _StepState) -> tuple[float, float]:
        """Forward micro-batch `act.mb` on part `act.part`: receive its input, run the part,
        send the output on. Returns the (start, end) of its compute."""
        stats, key = run.stats, (act.mb, act.part)
        prev, nxt = self.route.prev(self.rank, act.part), self.route.next(self.rank, act.part)
        if prev is None:
            assert run.x_mbs is not None
            x = run.x_mbs[act.mb]
        else:
            x = self._recv(prev[0], self._tag("F", act.mb, prev[1]), run.rec)
            if x.is_floating_point():
                x.requires_grad_()
        start = time.perf_counter()
        before = stats.saved_live
        if self._checkpointed(act.mb):
            # keep only the input (counted) and the RNG state; backward runs it again
            run.rng[key] = _rng_state(self.device)
            with torch.no_grad():
                y = self._call(x, act.part)
            run.kept[key] = Saved(x, stats)
        elif self._cutter is not None:  # split backward: cut at the layers, kept for B and W
            with stats.counting(), self._cutter.recording() as pieces:
                y = self._call(x, act.part)
                if nxt is None and run.t_mbs is not None:
                    self._loss(act.mb, leaf(y), run, pieces)
            run.pieces[key] = pieces
            run.outs[key] = y
        else:
            with stats.counting():
                y = self._call(x, act.part)
                if nxt is None:
                    self._loss(act.mb, y, run)
            run.outs[key] = y
        stats.mb_saved_bytes.append(stats.saved_live - before)
        end = time.perf_counter()
        run.ins[key] = x
        run.inflight += 1
        stats.peak_inflight = max(stats.peak_inflight, run.inflight)
        if nxt is not None:
            self._send(y, nxt[0], self._tag("F", act.mb, act.part), run)
        return start, end

    def _backward(self, act: Action, run: _StepState, final: bool) -> tuple[float, float]:
        """Backward micro-batch `act.mb` on part `act.part`: receive its output gradient,
        backpropagate through the part, send the input gradient back (split: the input
        gradient only; W computes the weights'). `final`: this stage's last backward of the
        step, the one run outside `accumulate` (it may reduce gradients).

        Returns the (start, end) of its compute."""
        key = (act.mb, act.part)
        prev, nxt = self.route.prev(self.rank, act.part), self.route.next(self.rank, act.part)
        grad = None if nxt is None else self._recv(nxt[0], self._tag("B", act.mb, nxt[1]), run.rec)
        start = time.perf_counter()
        x = run.ins.pop(key)
        if self._cutter is not None:
            pieces = run.pieces[key]
            root = run.losses.pop(act.mb) if nxt is None else run.outs.pop(key)
            if nxt is None:
                run.outs.pop(key)
                run.total = root.detach() if run.total is None else run.total + root.detach()
            gx = input_grad(pieces, root, grad, need=x if prev is not None else None)
            end = time.perf_counter()
            if prev is not None:
                gx = gx if gx is not None else torch.zeros_like(x)
                self._send(gx, prev[0], self._tag("B", act.mb, act.part), run)
            return start, end
        if key in run.kept:
            # re-materialise: the input's bytes are autograd's again from here
            del run.kept[key]
            on_gpu = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=on_gpu):
                _set_rng_state(self.device, run.rng.pop(key))
                with run.stats.counting():
                    y = self._call(x, act.part)
                    if nxt is None:
                        self._loss(act.mb, y, run)
        else:
            y = run.outs.pop(key)
        hold: Accumulate = contextlib.nullcontext
        if run.accumulate is not None and not final:
            hold = run.accumulate
        with hold():
            if nxt is None:
                loss = run.losses.pop(act.mb)
                loss.backward()
                run.total = loss.detach() if run.total is None else run.total + loss.detach()
            elif y.requires_grad:
                torch.autograd.backward(y, grad)
        end = time.perf_counter()
        del y
        run.inflight -= 1
        if prev is not None:
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            self._send(gx, prev[0], self._tag("B", act.mb, act.part), run)
        return start, end

    def _weight(self, act: Action, run: _StepState, final: bool) -> tuple[float, float]:
        """W of micro-batch `act.mb`: the weight gradients its B left for later (split.py);
        frees its graph. Returns the (start, end) of its compute."""
        start = time.perf_counter()
        hold: Accumulate = contextlib.nullcontext
        if run.accumulate is not None and not final:
            hold = run.accumulate
        with hold():
            weight_grad(run.pieces.pop((act.mb, act.part)))
        run.inflight -= 1
        return start, time.perf_counter()

    def _sync(self) -> None:
        """With parts and a data-parallel wrapper: every backward ran inside `accumulate`
        (no one of them holds all the stage's gradients), so one more autograd pass, adding
        zeros to every parameter's gradient, lets the wrapper reduce them all at once. Not
        overlapped with the backward; the price of reducing each gradient once."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        torch.autograd.backward(params, [torch.zeros_like(p) for p in params])

    def _loss(
        self, mb: int, y: torch.Tensor, run: _StepState, pieces: Pieces | None = None
    ) -> None:
        """On the last stage: micro-batch mb's loss, weighted by its share of the batch.
        Split: `y` is the output cut from its graph, and the loss is the last piece."""
        if run.t_mbs is not None:
            t = run.t_mbs[mb]
            run.losses[mb] = run.loss_fn(y, t) * (len(t) / run.batch)
            if pieces is not None:
                pieces.items.append(Piece(None, y, run.losses[mb]))

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only, in one piece (no micro-batches; for evaluation): the model's output
        on the last stage, None elsewhere. `inputs` is needed on the first stage."""
        if self.first and inputs is None:
            raise ValueError("stage 0 needs inputs (got None)")
        y: torch.Tensor | None = None
        for part in range(self.parts):
            prev, nxt = self.route.prev(self.rank, part), self.route.next(self.rank, part)
            if prev is None:
                x = inputs
            else:
                x = recv_tensor(self.comm, prev[0], self._tag("F", 0, prev[1]), self.device)
            assert x is not None
            y = self._call(x, part)
            if nxt is None:
                return y
            for req in send_tensor(self.comm, y, nxt[0], self._tag("F", 0, part)):
                req.wait()
        return None

    def _split(self, t: torch.Tensor | None, name: str) -> list[torch.Tensor]:
        if t is None:
            raise ValueError(f"stage {self.rank} needs {name} (got None)")
        if t.dim() == 0 or len(t) < self.chunks:
            n = 0 if t.dim() == 0 else len(t)
            raise ValueError(f"{name} has batch size {n}, fewer than chunks={self.chunks}")
        # exactly `chunks` pieces, sizes differing by one at most (torch.chunk may give
        # fewer: 4 samples in 3 chunks are 2 pieces of 2)
        return list(torch.tensor_split(t, self.chunks))


class Parts(nn.ModuleList):
    """An interleaved stage: its parts (one `nn.Sequential` each), `forward(x, part)` runs
    one. Its parameters are all the parts', for optimizers and data-parallel wrappers."""

    def forward(self, x: torch.Tensor, part: int = 0) -> torch.Tensor:
        out: torch.Tensor = self[part](x)
        return out


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG states a re-run forward needs: the CPU's, and `device`'s if a GPU."""
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, gpu = state
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, device)

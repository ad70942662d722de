"""What a pipeline stage does for each action of its schedule, and what it sends on the way.

    F   forward micro-batch mb on a part: receive its input (or take the batch's), run the
        part, keep what backward needs (all of it, only the input when checkpointed, or the
        graph cut at the layers when the backward is split), send the output on
    B   its backward: receive the output gradient, backpropagate, send the input gradient
        back; split (zb-h1): the input gradient only, W computes the weights' later
    W   the weight gradients a split B left (split.py)

`StageActions` is the base of `Pipeline` (pipe.py), which cuts the model, builds the stage
and drives a step through its action list; what one step carries from action to action is
a `StepState`. Activations and gradients travel with a small shape header (p2p.py).
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
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.route import Route
from plait.pipeline.schedule import Action
from plait.pipeline.split import Cutter, Piece, Pieces, close, input_grad, leaf, weight_grad
from plait.pipeline.stats import PipeStats
from plait.saved_tensors import Held
from plait.trace.recorder import Recorder

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Accumulate = Callable[[], contextlib.AbstractContextManager[Any]]

Key = tuple[int, int]  # (micro-batch, part): what a stage holds between its actions


@dataclass
class StepState:
    """What one `Pipeline.step` carries from action to action (keyed by (micro-batch, part))."""

    x_mbs: list[torch.Tensor] | None  # first stage: the input micro-batches
    t_mbs: list[torch.Tensor] | None  # last stage: the target micro-batches
    loss_fn: LossFn
    accumulate: Accumulate | None
    stats: PipeStats
    batch: int = 0  # the last stage's batch size: each micro-batch's loss weight is len / batch
    ins: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage inputs, for backward
    outs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage outputs, ditto
    kept: dict[Key, Held] = field(default_factory=dict)  # checkpointed: the input, counted
    # checkpointed micro-batches: the RNG states (CPU, and the stage's GPU) at their forward
    rng: dict[Key, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    pieces: dict[Key, Pieces] = field(default_factory=dict)  # split backward: the cut graph
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: list[Request] = field(default_factory=list)  # sends, waited for at the end
    total: torch.Tensor | None = None  # the last stage's loss so far
    inflight: int = 0  # (micro-batch, part)s forwarded whose backward (W if split) has not run
    rec: Recorder | None = None  # plait.trace's, while a trace records


class StageActions:
    """One rank's stage, action by action (`Pipeline` builds it and drives a step)."""

    comm: Communicator  # the pipeline's
    rank: int  # this stage's
    chunks: int  # micro-batches per step
    parts: int  # model parts this rank holds (v; interleaved: > 1)
    route: Route  # which rank and part each virtual stage talks to
    checkpoint: str  # re-materialisation: never, except_last, always
    stage: nn.Module  # this rank's layers (a `Parts` when interleaved), or a wrapper of them
    part_layers: list[list[nn.Module]]  # each part's layers, unwrapped
    _cutter: Cutter | None  # split backward (zb-h1): cuts the forward at the layers

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

    def _send(self, t: torch.Tensor, peer: int, tag: int, run: StepState) -> None:
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

    def _forward(self, act: Action, run: StepState) -> tuple[float, float]:
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
            run.kept[key] = stats.saved.hold(x)
        elif self._cutter is not None:  # split backward: cut at the layers, kept for B and W
            with stats.counting(), self._cutter.recording() as pieces:
                y = self._call(x, act.part)
                close(pieces, y)
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

    def _backward(self, act: Action, run: StepState, final: bool) -> tuple[float, float]:
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
            # no weight gradient here: a wrapper (ZeRO-3's, which gathers for backward and
            # would reduce at the pass's end) holds its reduction for the W that has them
            hold_b = run.accumulate or contextlib.nullcontext
            with hold_b():
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

    def _weight(self, act: Action, run: StepState, final: bool) -> tuple[float, float]:
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
        overlapped with the backward; the price of reducing each gradient once. The layers'
        own parameters, not the wrapper's (ShardedDataParallel's are its shards)."""
        layers = [layer for part in self.part_layers for layer in part]
        params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        torch.autograd.backward(params, [torch.zeros_like(p) for p in params])

    def _loss(self, mb: int, y: torch.Tensor, run: StepState, pieces: Pieces | None = None) -> None:
        """On the last stage: micro-batch mb's loss, weighted by its share of the batch.
        Split: `y` is the output cut from its graph, and the loss is the last piece."""
        if run.t_mbs is not None:
            t = run.t_mbs[mb]
            run.losses[mb] = run.loss_fn(y, t) * (len(t) / run.batch)
            if pieces is not None:
                pieces.items.append(Piece(None, y, run.losses[mb]))


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG states a re-run forward needs: the CPU's, and `device`'s if a GPU."""
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, gpu = state
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, device)

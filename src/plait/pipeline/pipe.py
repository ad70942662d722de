"""The pipeline runtime: run one stage of a sequential model under a schedule.

`Pipeline` cuts an `nn.Sequential` (or a list of modules) into `p` contiguous stages, one
per rank of the pipeline communicator (with `virtual=v`, into p*v virtual stages, v per
rank: route.py), keeps this rank's, and runs the actions that `build(schedule, p, chunks,
v)` lists for it, one after the other (`step`). What each action does (F, B, W) and the
activations and gradients it sends are actions.py's; how the layers are split is
balance.py's; what a step measures is stats.py's.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.mesh import Mesh
from plait.pipeline.actions import Accumulate, LossFn, StageActions, StepState
from plait.pipeline.balance import stage_sizes
from plait.pipeline.p2p import recv_tensor, send_tensor
from plait.pipeline.route import Route, lanes_agree
from plait.pipeline.schedule import SCHEDULES, ScheduleError, build
from plait.pipeline.split import Cutter
from plait.pipeline.stats import PipeStats

CHECKPOINTS = ("never", "except_last", "always")


class Pipeline(StageActions):
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
        run = StepState(
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

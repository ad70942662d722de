"""The peer of `plait bench pipeline`: torch.distributed.pipelining on the same model.

Each plait schedule has a torch counterpart, built on the job's default (gloo) process
group that `plait.init()` set up:

    gpipe        ScheduleGPipe
    1f1b         Schedule1F1B
    interleaved  ScheduleInterleaved1F1B, v stages per rank (virtual stage j*p + r on rank
                 r, as plait places them)
    zb-h1        ScheduleInterleavedZeroBubble with one stage per rank (torch's zero-bubble
                 schedule, which splits backward into input and weight gradients as ZB-H1
                 does; it has no ZB-H1 of its own)

Same layers, same split (as even as possible, the same counts plait's `split_sizes`
gives), the same batch, micro-batches and mean-squared-error loss. torch scales each
micro-batch's loss by 1/M itself (`scale_grads`), as plait weights them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}
MULTI = ("interleaved", "zb-h1")  # built from a list of stages (torch's multi-stage API)


class TorchPipe:
    """One rank's torch.distributed.pipelining schedule of `model`'s layers."""

    def __init__(
        self, model: nn.Sequential, schedule: str, chunks: int, parts: int, rank: int, size: int
    ) -> None:
        from torch.distributed import pipelining

        from plait.pipeline import split_sizes

        self.rank, self.size = rank, size
        layers = list(model)
        n = size * parts
        sizes = split_sizes(len(layers), n)
        stages = []
        for j in range(parts):
            v = j * size + rank
            start = sum(sizes[:v])
            part = nn.Sequential(*layers[start : start + sizes[v]])
            stages.append(pipelining.PipelineStage(part, v, n, torch.device("cpu")))
        self.modules = [s.submod for s in stages]
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        stage: Any = stages if schedule in MULTI else stages[0]
        self.schedule = cls(stage, chunks, loss_fn=_mse)
        self.first, self.last = rank == 0, rank == size - 1  # virtual stages 0 and n - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()

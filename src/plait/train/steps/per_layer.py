"""`--strategy allreduce --plan FILE|best`: each layer of the model data-parallel or split its
own way over the ranks, as a per-layer plan says (plait.parallel.apply).

Every rank builds the whole model from the run's seed (so every copy starts alike) and
`apply` keeps this rank's parts: a data layer whole, a column or row layer's slice, a
rank:R layer on rank R alone; between layers whose layouts differ it converts the
activations with collectives. Each rank feeds its rows of every global batch, as under
data parallelism, and gets its rows of the output, so its loss is the data-parallel one:
after backward `finish_gradients` leaves every gradient the single-process gradient of
the global batch's mean loss, and the optimizer steps this rank's parameters (a slice
steps as its whole layer would: sgd and adamw are elementwise; layer_plan.py refuses lars
and lamb). fp32 only, no checkpoints yet (layer_plan.py says why).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.communicator import Communicator
from plait.parallel import apply
from plait.parallel.layout import LayerPlan
from plait.train import memory
from plait.train.config import TrainConfig
from plait.train.evaluate import evaluate_rows
from plait.train.optimizers import make_optimizer
from plait.train.steps.allreduce import AllreduceStep
from plait.train.steps.compute import Compute
from plait.train.workload import LossFn, Workload


class _Nothing:
    """The parameters of a rank that holds none: one empty tensor that never has a
    gradient (an optimizer skips it), so the loop's optimizer and schedule run alike."""

    def __init__(self) -> None:
        self.empty = torch.nn.Parameter(torch.empty(0))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.empty]


class PerLayerStep(AllreduceStep):
    """This rank's parts of the model, laid out by the run's per-layer plan over `comm`."""

    compute: Compute

    def __init__(self, config: TrainConfig, comm: Communicator, work: Workload) -> None:
        assert config.layer_plan is not None, "--plan, read by TrainConfig"
        self.plan = LayerPlan.from_json(config.layer_plan)
        whole = self.whole_model(config, comm, work)  # the seed's, alike on every rank
        self.model = apply(whole, self.plan, comm)
        # fp32 (layer_plan.py refuses the rest): the trace's events and the activations'
        # bytes, counted on the first step, as every Step's
        self.compute = Compute(config, self.device, recorder=comm.recorder)
        # this rank's parameters; a rank that holds none (every layer rank:R elsewhere)
        # steps an empty placeholder, as torch's optimizers take no empty list
        held = self.model if any(True for _ in self.model.parameters()) else _Nothing()
        self.optimizer = make_optimizer(held, config)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """This rank's rows in and out: its loss is its rows' mean, as under data
        parallelism; `finish_gradients` then sums the replicated parameters' gradients and
        scales every one to the global batch's mean loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.compute.forward_backward(self.model, x, y, loss_fn)
        self.model.finish_gradients()
        return loss

    def clip(self, max_norm: float) -> None:
        self.model.clip_grad_norm_(max_norm)  # the norm over every rank's parameters

    def evaluate(self) -> float:
        """Each rank its rows of every held-out batch through the per-layer model (every
        forward a collective: the same count and shapes on every rank)."""
        return evaluate_rows(self.model, self.work, self.comm, self.device)

    def figures(self) -> dict[str, Any]:
        # rank_memory: each rank's own parameters, gradients and optimizer state (a split
        # layer's slice, a rank:R layer on R alone), as the other Steps report it (`plait
        # bench plan` compares it with the planner's prediction); a collective
        mine = memory.held(self.model, self.optimizer, self.compute.activation_bytes or 0)
        return {**self.compute.figures(), "plan": self.plan.to_json(),
                "rank_memory": self.comm.allgather_object(mine)}  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "plan": self.plan.label()}

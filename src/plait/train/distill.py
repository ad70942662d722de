"""Knowledge distillation (Hinton, Vinyals, Dean 2015, "Distilling the Knowledge in a
Neural Network"): the student learns the labels and the teacher's softened outputs,

    L = A * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - A) * CE(student, y)

per sample for classifiers, per token for language models, averaged as the workload's
cross-entropy is. T^2 keeps the soft term's gradients at the scale of the hard term's as T
changes (the paper, section 2).

Where it runs: the loop (`RankRun.batch_of`) reads a slice (x, y) as for any run, runs the
teacher on x under `torch.no_grad` on the Step's device, and packs its logits and the
labels into ONE float32 target tensor (`pack`). Every Step hands its targets to the loss
untouched (a pipeline cuts them into micro-batches along dim 0, which keeps the packing),
and the loss (`Distiller.loss`) unpacks them. So every strategy and mesh distils without a
line of its own. Under a mesh every rank of a dp index computes the teacher's forward on
the same slice: redundant (only the last pipeline stage uses it, and tp ranks compute the
same) but correct, and simple. Held-out evaluation reads plain labels: the
metric is the student's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.recipes import MODEL_TASK, TASK_NAMES
from plait.train.trained import load_run
from plait.train.workload import Workload

__all__ = ["Distiller", "describe", "distillation_loss", "load", "pack", "unpack"]

EXACT_LABELS = 2**24  # float32 holds every integer below this exactly


def pack(teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Teacher logits (..., C) and labels (...) as one float32 tensor (..., C + 1): the
    logits, then the label as a float (exact below 2^24)."""
    # (batch, C + 1) or (batch, seq, V + 1)
    return torch.cat([teacher.float(), labels.unsqueeze(-1).float()], dim=-1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (teacher logits (..., C), labels (...) as int64)."""
    return packed[..., :-1], packed[..., -1].long()


def distillation_loss(
    student: torch.Tensor, packed: torch.Tensor, temperature: float, weight: float
) -> torch.Tensor:
    """A * T^2 * KL(p_teacher || p_student) + (1 - A) * CE(student, labels), both softened
    by T, the mean over samples (or tokens): a slice's loss times its share of the batch
    adds up to the batch's, as the training loop needs. Computed in float32, autocast or
    not.

    Args:
        student: logits (batch, classes) or (batch, seq, vocab).
        packed: `pack(teacher logits, labels)` of the same batch.
        temperature: T > 0.
        weight: A in [0, 1], the soft term's.
    """
    teacher, labels = unpack(packed)
    if teacher.shape != student.shape:
        raise ConfigError(
            f"the teacher's outputs {tuple(teacher.shape)} do not match the student's "
            f"{tuple(student.shape)}: distil between models of the same classes (vocabulary)"
        )
    with torch.autocast(student.device.type, enabled=False):
        s = student.float().reshape(-1, student.shape[-1])  # (samples or tokens, classes)
        t = teacher.reshape(-1, teacher.shape[-1])
        hard = F.cross_entropy(s, labels.reshape(-1))
        if weight == 0:
            return hard
        log_p_t = F.log_softmax(t / temperature, dim=-1)
        log_p_s = F.log_softmax(s / temperature, dim=-1)
        kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean()  # per sample, then mean
        soft = temperature**2 * kl
        return soft if weight == 1 else weight * soft + (1 - weight) * hard


@dataclass
class Distiller:
    """A trained teacher on the Step's device, and the loss that distils from it."""

    model: nn.Module
    temperature: float
    weight: float
    figures: dict[str, Any]  # what the run reports of the teacher (`load`)

    @torch.no_grad()
    def targets(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The packed targets of slice (x, y): the teacher's logits on x and the labels."""
        return pack(self.model(x), y)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return distillation_loss(output, target, self.temperature, self.weight)


def load(config: TrainConfig, work: Workload, device: torch.device) -> Distiller | None:
    """The teacher --teacher names, on `device`, checked against the student; None without
    --teacher.

    Raises:
        CheckpointError: no trained run there (load_run's).
        ConfigError: the teacher trained on other data, or its outputs' shape is not the
            student's (checked on one batch).
    """
    d = config.distill
    if d.teacher is None:
        return None
    trained = load_run(d.teacher)
    check_data(trained.options, config, d.teacher)
    x, _ = work.data.train_batch(torch.arange(min(2, work.data.num_train)))
    with torch.no_grad():
        mine = work.build_model(config.workload.seed)(x).shape
        try:
            theirs = trained.model(x).shape
        except RuntimeError as e:  # images into a language model, or the other way round
            raise ConfigError(
                f"teacher {d.teacher} ({trained.name}) cannot read the student's inputs "
                f"{tuple(x.shape)} ({x.dtype}): {str(e).splitlines()[0]}"
            ) from None
    if mine != theirs:
        raise ConfigError(
            f"teacher {d.teacher} ({trained.name}) gives outputs of shape {tuple(theirs)}, "
            f"the student ({work.name}) {tuple(mine)} on the same batch: distillation needs "
            "the same classes (vocabulary) and sequence length"
        )
    if theirs[-1] >= EXACT_LABELS:  # the labels travel as float32 (pack)
        raise ConfigError(f"{theirs[-1]} classes >= 2^24: labels would not pack exactly")
    metric = trained.workload.metric
    figures = {"dir": d.teacher, "model": trained.name, "parameters": trained.parameters,
               "metric": trained.metric, "metric_name": metric.name,
               "metric_unit": metric.unit,
               "token": getattr(trained.workload.data, "token", None)}  # fmt: skip
    for p in trained.model.parameters():
        p.requires_grad_(False)  # the teacher only infers: no gradient reaches it
    return Distiller(trained.model.to(device), d.distill_temperature, d.distill_weight, figures)


def check_data(teacher: dict[str, Any], config: TrainConfig, where: str) -> None:
    """Raise ConfigError unless the teacher trained on the student's data (a --workload
    student: the same --workload)."""
    w = config.workload
    if w.given:  # a Workload object: nothing to compare but the outputs' shape
        return
    tasks = (MODEL_TASK.get(teacher.get("model") or ""), MODEL_TASK.get(w.model or ""))
    if None not in tasks and tasks[0] != tasks[1]:
        raise ConfigError(
            f"teacher {where} ({teacher.get('model')}) does {TASK_NAMES[str(tasks[0])]}, the "
            f"student ({w.model}) {TASK_NAMES[str(tasks[1])]}: distil between models of "
            "one task"
        )
    theirs, mine = _source(teacher.get("workload"), teacher.get("data")), _source(w.path, w.data)
    if theirs != mine:
        raise ConfigError(
            f"teacher {where} trained on {theirs}, the student on {mine}: distil on the data "
            f"the teacher learnt ({theirs}), or train a teacher on {mine}"
        )


def _source(workload: str | None, data: str | None) -> str:
    """What a run trained on, as its options name it: "--workload M:F" or "--data NAME"."""
    return f"--workload {workload}" if workload else f"--data {data}"


def describe(distiller: Distiller) -> dict[str, Any]:
    """The --json figures and the header's: the teacher, T and A."""
    return {"teacher": dict(distiller.figures), "distill_temperature": distiller.temperature,
            "distill_weight": distiller.weight}  # fmt: skip

"""Knowledge distillation's loss in one process: Hinton et al.'s formula computed in plain
Python, slices weighted by their size, and gradients that reach the student only (the
distilled runs are in tests/world/test_distill.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.train import distill


def _hand(student: list[list[float]], teacher: list[list[float]], labels: list[int],
          t: float, a: float) -> float:  # fmt: skip
    """Hinton et al.'s loss in plain Python, row by row (a row: a sample or a token)."""

    def log_softmax(row: list[float], temp: float) -> list[float]:
        z = [v / temp for v in row]
        top = max(z)
        norm = top + math.log(sum(math.exp(v - top) for v in z))
        return [v - norm for v in z]

    total = 0.0
    for s, te, y in zip(student, teacher, labels, strict=True):
        lt, ls = log_softmax(te, t), log_softmax(s, t)
        kl = sum(math.exp(p) * (p - q) for p, q in zip(lt, ls, strict=True))
        ce = -log_softmax(s, 1.0)[y]
        total += a * t * t * kl + (1 - a) * ce
    return total / len(labels)


SHAPES = [(6, 5), (3, 4, 7)]  # (batch, classes), (batch, seq, vocab)


def _tensors(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(len(shape))
    student = torch.randn(shape, generator=g) * 2
    teacher = torch.randn(shape, generator=g) * 3
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return student, teacher, labels


@pytest.mark.parametrize("shape", SHAPES)
def test_the_loss_is_hintons_formula(shape: tuple[int, ...]) -> None:
    student, teacher, labels = _tensors(shape)
    rows = (student.reshape(-1, shape[-1]).tolist(), teacher.reshape(-1, shape[-1]).tolist(),
            labels.reshape(-1).tolist())  # fmt: skip
    packed = distill.pack(teacher, labels)
    assert packed.dtype == torch.float32 and packed.shape == (*shape[:-1], shape[-1] + 1)
    assert torch.equal(distill.unpack(packed)[1], labels)
    for t, a in ((4.0, 0.7), (1.0, 0.5), (2.0, 0.0), (2.0, 1.0)):
        got = distill.distillation_loss(student, packed, t, a).item()
        assert got == pytest.approx(_hand(*rows, t, a), rel=1e-5)
    flat = student.reshape(-1, shape[-1])
    plain = F.cross_entropy(flat, labels.reshape(-1))
    torch.testing.assert_close(distill.distillation_loss(student, packed, 3.0, 0.0), plain)
    soft = F.log_softmax(teacher.reshape(flat.shape) / 3, -1)
    kd = 9.0 * F.kl_div(F.log_softmax(flat / 3, -1), soft, reduction="batchmean", log_target=True)
    torch.testing.assert_close(distill.distillation_loss(student, packed, 3.0, 1.0), kd)


@pytest.mark.parametrize("shape", SHAPES)
def test_slices_weighted_by_size_average_to_the_batch(shape: tuple[int, ...]) -> None:
    student, teacher, labels = _tensors(shape)
    packed = distill.pack(teacher, labels)
    whole = distill.distillation_loss(student, packed, 2.0, 0.6)
    cut = 2  # unequal halves: 2 and batch - 2 samples
    parts = sum(
        distill.distillation_loss(s, p, 2.0, 0.6) * (len(s) / len(student))
        for s, p in ((student[:cut], packed[:cut]), (student[cut:], packed[cut:]))
    )
    torch.testing.assert_close(parts, whole)


def test_gradients_reach_the_student_only_and_the_kl_stays_float32() -> None:
    torch.manual_seed(0)
    teacher, student = nn.Linear(8, 5), nn.Linear(8, 5)
    d = distill.Distiller(teacher, 2.0, 0.5, {})
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    packed = d.targets(x, y)
    assert not packed.requires_grad
    d.loss(student(x), packed).backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = student(x)
        loss = d.loss(low, packed)
    assert low.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, d.loss(low.float(), packed))

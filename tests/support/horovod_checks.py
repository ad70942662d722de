"""What the Horovod tests share: checks collected rather than raised, the small model and batches
they train against one process, training with join, and the environment of a CUDA world."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ENV = {"PLAIT_TIMEOUT": "20"}  # a hang becomes an error with a traceback
f64 = torch.float64


class Checks:
    """One rank's failed checks, kept by section (`begin`) and reported together at the end, so
    that a failure names the part of a battery that broke."""

    def __init__(self) -> None:
        self.section = ""
        self.failures: dict[str, list[str]] = {}

    def begin(self, section: str) -> None:
        """The checks from here on belong to `section`."""
        self.section = section
        self.failures[section] = []

    def fail(self, text: str) -> None:
        self.failures[self.section].append(text)

    def close(self, name: str, got: Any, want: Any, rtol: float = 1e-6, atol: float = 1e-6) -> None:
        # torch.allclose, not torch.testing: importing that costs a second per process here
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.allclose(got, want, rtol=rtol, atol=atol)
        )
        if not ok:
            self.fail(f"{name}: got {got!r}, want {want!r}")

    def equal(self, name: str, got: Any, want: Any) -> None:
        same = (
            isinstance(got, torch.Tensor)
            and isinstance(want, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got, want)
        ) or (not isinstance(want, torch.Tensor) and got == want)
        if not same:
            self.fail(f"{name}: got {got!r}, want {want!r}")

    def true(self, name: str, cond: object) -> None:
        if not cond:
            self.fail(name)

    def raises(
        self,
        name: str,
        exc: type[BaseException] | tuple[type[BaseException], ...],
        fn: Callable[[], object],
        match: str = "",
    ) -> BaseException | None:
        try:
            fn()
        except exc as e:
            if match not in str(e):
                self.fail(f"{name}: {type(e).__name__} without {match!r}: {e}")
            return e
        except Exception as e:
            self.fail(f"{name}: raised {type(e).__name__}: {e}")
            return None
        self.fail(f"{name}: did not raise {exc}")
        return None

    def run(self, hvd: Any, sections: dict[str, Callable[..., None]], *args: Any) -> None:
        """Each section in turn: section(hvd, self, *args)."""
        for name, check in sections.items():
            self.begin(name)
            check(hvd, self, *args)


def assert_section(failures: list[dict[str, list[str]]], section: str) -> None:
    """Every rank passed `section` (`failures`: each rank's Checks.failures)."""
    assert all(section in mine for mine in failures), f"no rank ran {section!r}"
    failed = [
        f"rank {rank}: {len(mine[section])} checks failed:\n" + "\n".join(mine[section][:40])
        for rank, mine in enumerate(failures)
        if mine[section]
    ]
    assert not failed, "\n".join(failed)


def data(
    shape: tuple[int, ...], seed: int, rank: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rank `rank`'s input: small integers, exact in every dtype and every reduction."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def make_model(seed: int = 0, extra: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    model = torch.nn.Sequential(*layers)
    if extra:  # a parameter that gets no gradient
        model.unused = torch.nn.Parameter(torch.ones(2, 2))  # a parameter, not a layer
    return model.double()


def make_batch(step: int, n: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: n*b samples, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n * b, 6, generator=g, dtype=f64), torch.randn(
        n * b, 3, generator=g, dtype=f64
    )


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def same_params(
    ck: Checks, name: str, got: torch.nn.Module, want: torch.nn.Module, tol: float = 1e-10
) -> None:
    for (pn, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        ck.close(f"{name}: {pn}", p.detach(), q.detach(), rtol=tol, atol=tol)


def join_in_training(hvd: Any, ck: Checks, n: int, r: int, device: str = "cpu") -> None:
    """Training with uneven data on `device`: rank r has 1 + r batches, then joins; the
    result against the one-process reference (also run on GPUs by test_horovod_cuda.py)."""
    model = torch.nn.Linear(6, 3).double().to(device)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    b = 4
    for step in range(1 + r):
        x, y = (t.to(device) for t in make_batch(step, n, b))
        opt.zero_grad()
        mse(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]).backward()
        opt.step()
    ck.equal("join in training: last", hvd.join(), n - 1)
    # the reference: at step s the ranks still training add their gradients, / size
    ref = torch.nn.Linear(6, 3).double()
    torch.nn.init.zeros_(ref.weight)
    torch.nn.init.zeros_(ref.bias)
    for step in range(1 + r):
        x, y = make_batch(step, n, b)
        grads = []
        for q in range(step, n):  # rank q trains at step s while s < 1 + q
            ref.zero_grad()
            mse(ref, x[q * b : (q + 1) * b], y[q * b : (q + 1) * b]).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / n
    same_params(ck, "join in training", model.cpu(), ref)

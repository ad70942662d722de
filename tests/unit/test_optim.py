"""plait.optim's LARS and LAMB in one process: the papers' formulas, and the settings of
`plait train --optimizer`.

Each optimizer against a direct re-computation of its paper's algorithm (written here from
the papers, per parameter); the trust ratio's meaning (a layer moves by lr times its own
norm); where it is 1; the excluded 1-D parameters against torch.optim's SGD and Adam; a
`LayerMap` that cuts parameters over several tensors (as ZeRO's shards do) giving the
same step as whole parameters. Then the configuration and its errors; the command line is
in tests/e2e/test_optim_command.py. Across ranks (DataParallel, ZeRO, tensor parallelism):
tests/world/test_optim_ranks.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait import LAMB, LARS
from plait.optim import LayerMap, Segment
from plait.train.checkpoint import check_matches
from plait.train.config import RECIPES, TrainConfig
from plait.train.errors import CheckpointError, ConfigError
from support.optim_reference import LRS, MAKE, STEPS, batch, gap, make


# ------------------------------------------------------------- the papers, re-computed
def lars_paper(ws: list[torch.Tensor], gs: list[torch.Tensor], vs: dict[int, torch.Tensor],
               lr: float, m: float, beta: float, eta: float, exclude: bool) -> None:  # fmt: skip
    """You et al. 2017, Algorithm 1, one step per parameter (λ = 1 for a zero norm)."""
    for i, (w, g) in enumerate(zip(ws, gs, strict=True)):
        b = 0.0 if exclude and w.dim() == 1 else beta
        wn, gn = float(w.norm()), float(g.norm())
        local = eta * wn / (gn + b * wn) if wn and gn and b == beta else 1.0
        vs[i] = m * vs.get(i, torch.zeros_like(w)) + lr * local * (g + b * w)
        w -= vs[i]


def lamb_paper(xs: list[torch.Tensor], gs: list[torch.Tensor], st: dict[int, Any], t: int,
               lr: float, b1: float, b2: float, eps: float, lam: float,
               bounds: tuple[float, float], exclude: bool) -> None:  # fmt: skip
    """You et al. 2020, Algorithm 2 with bias correction, one step per parameter."""
    for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
        m, v = st.get(i, (torch.zeros_like(x), torch.zeros_like(x)))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        st[i] = (m, v)
        excluded = exclude and x.dim() == 1
        r = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + (0 if excluded else lam) * x
        xn, rn = float(x.norm()), float(r.norm())
        phi = min(max(xn, bounds[0]), bounds[1])
        x -= lr * (phi / rn if xn and rn and not excluded else 1.0) * r


def grads_of(model: nn.Module, step: int) -> None:
    model.zero_grad(set_to_none=True)
    x, y = batch(step, 6)
    nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("exclude", [False, True])
def test_lars_is_algorithm_1(exclude: bool) -> None:
    mine, ref = make(), make()
    opt = LARS(mine.parameters(), lr=1.0, momentum=0.9, weight_decay=0.01,
               trust_coefficient=0.02, exclude_1d=exclude)  # fmt: skip
    vs: dict[int, torch.Tensor] = {}
    for step in range(4):
        grads_of(mine, step), grads_of(ref, step)
        opt.param_groups[0]["lr"] = LRS[step % 3]
        opt.step()
        with torch.no_grad():
            ps = list(ref.parameters())
            lars_paper(ps, [p.grad for p in ps], vs, LRS[step % 3], 0.9, 0.01, 0.02, exclude)
    assert gap(mine.state_dict(), ref.state_dict()) < 1e-13


@pytest.mark.parametrize(("bounds", "exclude"), [((0.0, math.inf), False), ((0.5, 1.5), True)])
def test_lamb_is_algorithm_2(bounds: tuple[float, float], exclude: bool) -> None:
    mine, ref = make(), make()
    opt = LAMB(mine.parameters(), lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
               weight_norm_bounds=bounds, exclude_1d=exclude)  # fmt: skip
    st: dict[int, Any] = {}
    for step in range(4):
        grads_of(mine, step), grads_of(ref, step)
        opt.step()
        with torch.no_grad():
            ps = list(ref.parameters())
            lamb_paper(ps, [p.grad for p in ps], st, step + 1, 0.1, 0.8, 0.95, 1e-6, 0.05,
                       bounds, exclude)  # fmt: skip
    assert gap(mine.state_dict(), ref.state_dict()) < 1e-13


def _moves(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, tuple[float, float]]:
    """Each parameter's (norm before, norm of its step) over one step."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads_of(model, 0)
    opt.step()
    return {n: (float(before[n].norm()), float((p.detach() - before[n]).norm()))
            for n, p in model.named_parameters()}  # fmt: skip


def test_each_layer_moves_by_lr_times_its_own_norm() -> None:
    """The trust ratio's point: a step's size is set by the layer, not by its gradient."""
    model = make()
    for name, (norm, step) in _moves(LARS(model.parameters(), lr=0.5, momentum=0.0), model).items():
        if norm > 0:  # LARS without momentum or decay: ||Δw|| = γ η ||w||
            assert step == pytest.approx(0.5 * 0.001 * norm, rel=1e-12), name
    model = make()
    moves = _moves(LAMB(model.parameters(), lr=0.01, weight_decay=0.0), model)
    for name, (norm, step) in moves.items():
        if norm > 0:  # LAMB: ||Δx|| = η ||x||
            assert step == pytest.approx(0.01 * norm, rel=1e-12), name
    model = make()
    capped = _moves(LAMB(model.parameters(), lr=0.01, weight_decay=0.0,
                         weight_norm_bounds=(0.0, 0.5)), model)  # fmt: skip
    big = [n for n, (norm, _) in capped.items() if norm > 0.5]
    assert big and all(capped[n][1] == pytest.approx(0.01 * 0.5, rel=1e-12) for n in big)


def _with_plain(make_mine: Callable[..., torch.optim.Optimizer],
                make_plain: Callable[..., torch.optim.Optimizer], steps: int) -> Any:  # fmt: skip
    """`steps` of our optimizer on a model and of torch's on another's 1-D parameters, with
    the same gradients (drawn, so that they do not depend on the other parameters)."""
    model, plain = make(), make()
    mine = make_mine(model.parameters())
    theirs = make_plain([p for p in plain.parameters() if p.dim() == 1])
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
            b.grad = a.grad.clone()
        mine.step(), theirs.step()
    ones = [n for n, p in plain.named_parameters() if p.dim() == 1]
    got, want = model.state_dict(), plain.state_dict()
    return {n: bool(torch.allclose(got[n], want[n], rtol=0, atol=1e-14)) for n in ones}


ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6)  # noqa: E731
SGD = lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9)  # noqa: E731


def test_excluded_1d_parameters_step_as_torch_optim() -> None:
    """exclude_1d: biases and norm scales take Adam's (LAMB) or momentum SGD's (LARS) step."""
    lamb = lambda ps: LAMB(ps, lr=0.01, betas=(0.9, 0.99), exclude_1d=True)  # noqa: E731
    assert all(_with_plain(lamb, ADAM, 3).values())
    lars = lambda ps: LARS(ps, lr=0.3, weight_decay=0.01, exclude_1d=True)  # noqa: E731
    assert all(_with_plain(lars, SGD, 3).values())


def test_a_layer_at_zero_takes_ratio_1() -> None:
    """The layer norms' biases start at zero: their first step is Adam's (SGD's) own, as
    ratio 1 gives; every other 1-D parameter is scaled by its trust ratio, unlike Adam's."""
    zero = [n for n, p in make().named_parameters() if p.dim() == 1 and not p.any()]
    assert zero == ["blocks.0.ln.bias", "blocks.1.ln.bias"]
    lamb = lambda ps: LAMB(ps, lr=0.01, betas=(0.9, 0.99))  # noqa: E731
    lars = lambda ps: LARS(ps, lr=0.3, weight_decay=0.01)  # noqa: E731
    for same in (_with_plain(lamb, ADAM, 1), _with_plain(lars, SGD, 1)):
        assert [n for n, equal in same.items() if equal] == zero


@pytest.mark.parametrize("name", sorted(MAKE))
def test_layers_cut_over_several_tensors_step_as_whole_ones(name: str) -> None:
    """The model's parameters end to end in two flat tensors cut inside a parameter, with
    padding after: a LayerMap of their segments gives the whole-parameter step."""
    whole, flat_model = make(), make()
    params = list(flat_model.parameters())
    full = torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(5).double()])
    cut = params[0].numel() + 4  # inside the second parameter
    halves = [nn.Parameter(full[:cut].clone()), nn.Parameter(full[cut:].clone())]
    segments: dict[int, list[Segment]] = {id(h): [] for h in halves}
    at = 0
    for i, p in enumerate(params):
        for h, lo in ((halves[0], 0), (halves[1], cut)):
            a, b = max(at, lo), min(at + p.numel(), lo + h.numel())
            if a < b:
                segments[id(h)].append(Segment(i, a - lo, b - lo))
        at += p.numel()
    layers = LayerMap([p.dim() for p in params], {k: tuple(v) for k, v in segments.items()},
                      [id(p) for p in params])  # fmt: skip
    opt, mine = MAKE[name](whole.parameters()), MAKE[name](halves, layers=layers)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        for p in whole.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        g = torch.cat([p.grad.reshape(-1) for p in whole.parameters()] + [torch.zeros(5).double()])
        halves[0].grad, halves[1].grad = g[:cut].clone(), g[cut:].clone()
        opt.step(), mine.step()
    got = torch.cat([h.detach() for h in halves])
    want = torch.cat([p.detach().reshape(-1) for p in whole.parameters()])
    torch.testing.assert_close(got[: want.numel()], want, rtol=0, atol=1e-14)
    assert got[want.numel() :].abs().max() == 0  # the padding belongs to no layer
    with pytest.raises(ValueError, match="not in this optimizer's layer map"):
        MAKE[name](whole.parameters(), layers=layers)


# ------------------------------------------------------------- configuration and the CLI
def test_each_optimizer_has_its_rates() -> None:
    for model, recipe in RECIPES.items():
        assert TrainConfig.from_options({"model": model}).optimizer == recipe.optimizer
        for name in ("sgd", "adamw", "lars", "lamb"):
            c = TrainConfig.from_options({"model": model, "optimizer": name})
            assert c.optim.lr == recipe.rates[name].lr and c.rates == recipe.rates[name]
    c = TrainConfig.from_options({"optimizer": "lamb", "batch_size": 512, "lr_scaling": "linear",
                                  "lr": 0.01})  # fmt: skip
    assert c.peak_lr == pytest.approx(0.01 * 512 / RECIPES["mlp"].base_batch)


def test_the_parameter_servers_refuse_layerwise_optimizers() -> None:
    for name in ("lars", "lamb"):
        with pytest.raises(ConfigError, match=f"--optimizer {name} does not run with --strategy "
                           "ps: each server steps its own slices"):  # fmt: skip
            TrainConfig.from_options({"strategy": "ps", "optimizer": name})
    ps = TrainConfig.from_options({"strategy": "ps", "optimizer": "adamw", "model": "mlp"}).ps
    assert ps is not None and ps.optimizer == "adam"
    with pytest.raises(ConfigError, match="optimizer 'adam' is not one of sgd, adamw, lars"):
        TrainConfig.from_options({"optimizer": "adam"})


def test_a_run_resumes_only_with_its_optimizer() -> None:
    """Another optimizer's state would not fit (LAMB's moments are no SGD momentum)."""
    saved = {"options": TrainConfig.from_options({"optimizer": "lamb"}).options()}
    check_matches(saved, TrainConfig.from_options({"optimizer": "lamb"}).options(), "runs/a")
    with pytest.raises(CheckpointError, match="with --optimizer 'lamb', this run has --optimizer "
                       "'sgd'"):  # fmt: skip
        check_matches(saved, TrainConfig().options(), "runs/a")

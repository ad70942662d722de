"""Per-layer plans (plait.parallel.apply) train like one process, at 2, 3 and 4 ranks.

One world per size, all started at once, each running every plan of four small models
(an MLP, a CNN, transformer blocks between linears, a tiny GPT): float64, plain SGD (no
momentum, no clipping, so a gradient scale error shows), 2 steps; after each, every rank's
parameters must be its part of the one-process model's trained on the global batch. Each
step's communication is counted: every rank issues exactly the plan's conversions'
collectives (forward, and backward where a layer with parameters comes before them), the
split blocks' own allreduces and one gradient allreduce per layer with "sum" gradients;
sends are counted over the ranks. Every conversion is also run alone on the collectives
against support/layout_reps.py's definition of exact, and the plans together must convert
between every pair of layouts a plan can ask for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import Communicator
from plait.errors import ConfigError
from plait.parallel import LayerPlan, apply, layers_of
from plait.parallel.convert import convert
from plait.parallel.layout import CONVERSIONS, FULL_SUM, Conversion, conversion, rank_of
from plait.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from support.cuda import gpu_env
from support.layout_reps import LAYOUTS, gradient_of, gradient_parts, value_of, value_parts
from support.world import run_world, worlds_at_once

f64 = torch.float64
ROWS = 2  # rows of the batch per rank
STEPS = 2
SIZES = (2, 3, 4)
Batch = tuple[torch.Tensor, torch.Tensor]  # (input, target), the global batch


# --------------------------------------------------------------------------- models
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 48), nn.Tanh(),
                         nn.Linear(48, 24), nn.Linear(24, 12))  # fmt: skip


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(36, 24), nn.ReLU(), nn.Linear(24, 12))  # fmt: skip


def _gpt_config() -> Any:
    from plait.train.gpt import GPTConfig

    return GPTConfig(vocab_size=24, block_size=4, n_layer=2, n_head=12, n_embd=24)


def _blocks() -> nn.Module:
    from plait.train.gpt import Block

    cfg = _gpt_config()
    return nn.Sequential(nn.Linear(12, 24), Block(cfg), Block(cfg), nn.Linear(24, 12))


def _gpt() -> nn.Module:
    from plait.train.gpt import GPT

    return GPT(_gpt_config())


def _floats(shape: tuple[int, ...], out: int) -> Callable[[int, torch.Generator], Batch]:
    def batch(n: int, gen: torch.Generator) -> Batch:
        x = torch.randn((n, *shape), generator=gen, dtype=f64)
        return x, torch.randn((n, *shape[:-1], out) if len(shape) > 1 else (n, out),
                              generator=gen, dtype=f64)  # fmt: skip

    return batch


def _images(n: int, gen: torch.Generator) -> Batch:
    return torch.randn(n, 2, 6, 6, generator=gen, dtype=f64), torch.randn(n, 12, generator=gen,
                                                                          dtype=f64)  # fmt: skip


def _ids(n: int, gen: torch.Generator) -> Batch:
    ids = torch.randint(0, 24, (n, 5), generator=gen)
    return ids[:, :4], ids[:, 1:]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Batch], Any]] = {
    "mlp": (_mlp, _floats((12,), 12), _mse),
    "cnn": (_cnn, _images, _mse),
    "blocks": (_blocks, _floats((4, 12), 12), _mse),
    "gpt": (_gpt, _ids, _ce),
}

# "last" is rank W-1; "-" a follow layer
PLANS: dict[str, list[str]] = {
    "mlp": [
        "data - data - data data",
        "column - row - column data",
        "row - row - row row",
        "rank:0 - column - last row",
        "column - rank:0 - rank:1 column",
        "row - rank:1 - data column",
        "column - column - row data",
        "last - last - data rank:0",
    ],
    "cnn": [
        "data - - - data - data",
        "data - - - column - row",
        "rank:0 - - - row - column",
        "data - - - last - data",
    ],
    "blocks": [
        "column split split data",
        "row split data column",
        "data split last row",
        "rank:0 split split column",
        "data split split row",
        "rank:0 rank:1 split rank:0",
        "row rank:0 data last",
    ],
    "gpt": [
        "data split split data",
        "rank:0 split data last",
        "data data rank:1 data",
    ],
}


def _choices(plan: str, w: int) -> tuple[str, ...]:
    names = {"-": "follow", "last": f"rank:{w - 1}"}
    return tuple(names.get(c, c) for c in plan.split())


# ------------------------------------------------------------- training against one process
def _mine(full: torch.Tensor, part: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's part of the one-process model's `full` tensor, shaped as `part` (a
    sharded dim is the one whose size differs: this rank's block of it)."""
    for dim in range(full.dim()):
        if part.shape[dim] != full.shape[dim]:
            full = full.chunk(comm.size, dim)[comm.rank]
    assert part.shape == full.shape
    return full


def _pairs(part: nn.Module, ref: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """`part`'s parameters with the one-process layer's (none where another rank holds it)."""
    mine = list(part.parameters())
    return list(zip(mine, ref.parameters(), strict=True)) if mine else []


def _worst(part: nn.Module, ref: nn.Module, comm: Communicator) -> float:
    """Largest difference of `part`'s parameters to its part of `ref`'s."""
    diffs = [(p - _mine(r, p, comm)).detach().abs().max() for p, r in _pairs(part, ref)]
    return max((float(d) for d in diffs), default=0.0)


def _expected_calls(par: Any, choices: tuple[str, ...]) -> tuple[int, int]:
    """(collectives every rank issues, sends over all ranks) in one step of this plan."""
    collectives = sends = 0
    for conv in par.resolved.conversions:
        ops = list(conv.forward)
        if any(c != "follow" for c in choices[: conv.before]):  # a gradient reaches it
            ops += conv.backward
        collectives += sum(op.moves_bytes and op.kind != "send" for op in ops)
        sends += sum(op.kind == "send" for op in ops)
    # Megatron's split: one allreduce forward per row-parallel layer (out, proj), one
    # backward per column-parallel input (q, k and v share one, fc: 2 per block)
    rows = sum(isinstance(m, RowParallelLinear) for m in par.modules())
    columns = [m for m in par.modules() if isinstance(m, ColumnParallelLinear)]
    inputs = {id(m.shared) for m in columns if m.shared is not None}
    tp = rows + len(inputs) + sum(m.shared is None for m in columns)
    # one allreduce per layer with "sum" gradients: a data layer's, a row layer's bias
    buckets = sum(c == "data" for c in choices) + sum(c == "row" for c in choices)
    return collectives + tp + buckets, sends


def _counting(comm: Communicator) -> list[int]:
    """Count this rank's sends (collectives have comm.issued)."""
    sent = [0]
    send = comm.send

    def counted(*args: Any, **kwargs: Any) -> None:
        sent[0] += 1
        send(*args, **kwargs)

    comm.send = counted  # type: ignore[method-assign]
    return sent


def _train(comm: Communicator, model: str, choices: tuple[str, ...], sent: list[int],
           device: str = "cpu") -> dict:  # fmt: skip
    make, batch, loss_fn = MODELS[model]
    w, rank = comm.size, comm.rank
    torch.manual_seed(0)
    ref = make().to(device, f64)
    torch.manual_seed(0)
    par = apply(make().to(device, f64), LayerPlan(choices, w), comm)
    ref_layers = layers_of(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    worst, calls = 0.0, []
    for _ in range(STEPS):
        x, y = (t.to(device) for t in batch(ROWS * w, gen))
        opt_ref.zero_grad()
        loss_fn(ref(x), y).backward()
        opt_ref.step()
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        opt.zero_grad()
        issued, sends = comm.issued, sent[0]
        loss_fn(par(x[mine]), y[mine]).backward()
        par.finish_gradients()
        calls.append((comm.issued - issued, sent[0] - sends))
        opt.step()
        for part, layer in zip(par.parts, ref_layers, strict=True):
            worst = max(worst, _worst(part, layer, comm))
    pairs = [(c.src, c.dst) for c in par.resolved.conversions]
    devices = sorted({str(p.device) for p in par.parameters()})
    return {"worst": worst, "calls": calls, "want": _expected_calls(par, choices),
            "pairs": pairs, "devices": devices}  # fmt: skip


def _clipped(comm: Communicator) -> dict[str, float]:
    """clip_grad_norm_'s norm and clipped gradients against torch's on the full model."""
    make, batch, loss_fn = MODELS["blocks"]
    w = comm.size
    torch.manual_seed(0)
    ref = make().to(f64)
    torch.manual_seed(0)
    par = apply(make().to(f64), LayerPlan(_choices("data split last row", w), w), comm)
    x, y = batch(ROWS * w, torch.Generator().manual_seed(2))
    loss_fn(ref(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    mine = slice(comm.rank * ROWS, (comm.rank + 1) * ROWS)
    loss_fn(par(x[mine]), y[mine]).backward()
    par.finish_gradients()
    got = float(par.clip_grad_norm_(0.01))
    worst = 0.0
    for part, layer in zip(par.parts, layers_of(ref), strict=True):
        for p, r in _pairs(part, layer):
            assert p.grad is not None and r.grad is not None
            worst = max(worst, float((p.grad - _mine(r.grad, p, comm)).abs().max()))
    return {"norm": abs(got - want) / want, "grads": worst}


# ------------------------------------------------------- each conversion on the collectives
def _every_pair(w: int) -> list[tuple[str, str]]:
    ranks = [f"rank:{r}" for r in range(w)]
    dsts = (*LAYOUTS[:4], *ranks)  # every layout but partial, which no layer takes
    return [(s, d) for s in (*LAYOUTS, *ranks) for d in dsts if s != d]


def _conversions(comm: Communicator) -> dict[str, Any]:
    """This rank's parts after each conversion's forward and backward, for the test to join."""
    w = comm.size
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2 * w, 3, 2 * w, dtype=f64, generator=gen)
    g = torch.randn(x.shape, dtype=f64, generator=gen)
    out = {}
    for src, dst in _every_pair(w):
        part = value_parts(src, x, w, gen)[comm.rank].requires_grad_()
        grad = gradient_parts(dst, g, w, gen)[comm.rank]
        fwd, bwd = conversion(src, dst)
        y = convert(part, Conversion(0, src, dst, fwd, bwd), comm, x.to("meta"))
        y.backward(grad)
        out[f"{src}>{dst}"] = (y.detach(), part.grad)
    return out


def _errors(comm: Communicator) -> dict[str, str]:
    w, out = comm.size, {}
    for name, plan in (("workers", LayerPlan(("data",), w + 1)),
                       ("choice", LayerPlan(("column",), w))):  # fmt: skip
        try:
            apply(nn.Sequential(nn.Linear(12, 13)).to(f64), plan, comm)
        except ConfigError as e:
            out[name] = str(e)
    par = apply(_mlp().to(f64), LayerPlan(_choices("column - row - column data", w), w), comm)
    rows = ROWS + (comm.rank == 0)  # rank 0 one row more: no rank has the even share
    try:
        par(torch.randn(rows, 12, dtype=f64))
    except ValueError as e:
        out["rows"] = str(e)
    return out


def _world(comm: Communicator) -> dict[str, Any]:
    sent = _counting(comm)
    runs = {
        f"{model}: {plan}": _train(comm, model, _choices(plan, comm.size), sent)
        for model, plans in PLANS.items()
        for plan in plans
    }
    return {"runs": runs, "clip": _clipped(comm), "conversions": _conversions(comm),
            "errors": _errors(comm)}  # fmt: skip


Ranks = list[dict[str, Any]]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[int, Future[Ranks]]]:
    """Every world, started at once (their ranks mostly wait for each other's messages)."""
    with worlds_at_once({n: (n, _world, (), {"timeout": 120}) for n in SIZES}) as worlds:
        yield worlds


@pytest.fixture(scope="module", params=SIZES)
def world(request: pytest.FixtureRequest, started: dict[int, Future[Ranks]]) -> Ranks:
    return started[request.param].result()


def test_every_plan_trains_like_one_process(world: Ranks) -> None:
    for rank in world:
        bad = {k: r["worst"] for k, r in rank["runs"].items() if not r["worst"] <= 1e-10}
        assert not bad, bad


def test_each_step_issues_the_plans_collectives_and_no_more(world: Ranks) -> None:
    for name in world[0]["runs"]:
        collectives, sends = world[0]["runs"][name]["want"]
        for step in range(STEPS):
            got = [rank["runs"][name]["calls"][step] for rank in world]
            assert [c for c, _ in got] == [collectives] * len(world), (name, step)
            assert sum(s for _, s in got) == sends, (name, step)


def test_the_plans_convert_between_every_pair_of_layouts(world: Ranks) -> None:
    def kind(layout: str) -> str:
        return "rank" if rank_of(layout) is not None else layout

    seen = {(kind(s), kind(d)) for r in world[0]["runs"].values() for s, d in r["pairs"]}
    # full+ is made only for a column layer, which takes it: no plan converts from it
    # (tests/unit/test_parallel_layout.py shows it over every plan of a model)
    want = {p for p in CONVERSIONS if p[0] != FULL_SUM}
    want |= {("rank", "rank")} | {(s, "rank") for s in LAYOUTS if s != FULL_SUM}
    want |= {("rank", d) for d in LAYOUTS if d != "partial"}
    assert seen == want, (want - seen, seen - want)


def test_every_conversion_is_exact_on_the_collectives(world: Ranks) -> None:
    w = len(world)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2 * w, 3, 2 * w, dtype=f64, generator=gen)
    g = torch.randn(x.shape, dtype=f64, generator=gen)
    for src, dst in _every_pair(w):
        outs = [rank["conversions"][f"{src}>{dst}"] for rank in world]
        got = value_of(dst, [y for y, _ in outs])
        assert float((got - x).abs().max()) < 1e-12, (src, dst)
        back = gradient_of(src, [gr for _, gr in outs])
        assert float((back - g).abs().max()) < 1e-12, (src, dst, "backward")


def test_clip_grad_norm_is_the_whole_models(world: Ranks) -> None:
    for rank in world:
        assert rank["clip"]["norm"] < 1e-12
        assert rank["clip"]["grads"] < 1e-12


def test_errors_say_what_was_expected(world: Ranks) -> None:
    w = len(world)
    for rank in world:
        e = rank["errors"]
        assert e["workers"].startswith(f"the plan is for {w + 1} ranks and the communicator")
        assert e["choice"].startswith(f"layer 0 (Linear(12, 13)) cannot run 'column' over {w}")
        assert "the batch's rows (dim 0)" in e["rows"] and "the same number" in e["rows"]


def _on_gpu(comm: Communicator) -> dict[str, Any]:
    import plait

    device = str(plait.device())
    return _train(comm, "blocks", _choices("row rank:0 data last", comm.size), _counting(comm),
                  device)  # fmt: skip


@pytest.mark.cuda
def test_a_plan_trains_like_one_process_on_cuda_tensors() -> None:
    """Two ranks on this machine's GPUs (sharing one where there is one): the conversions'
    collectives, the placeholders and the gradient buckets on CUDA tensors."""
    for rank in run_world(2, _on_gpu, env=gpu_env(), timeout=120):
        assert rank["worst"] <= 1e-10, rank["worst"]
        assert all(d.startswith("cuda") for d in rank["devices"]), rank["devices"]
        assert [c for c, _ in rank["calls"]] == [rank["want"][0]] * STEPS

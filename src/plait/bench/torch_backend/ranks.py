"""`plait bench torch-backend`, a worker rank: the same torch code on the "plait" group and
on its peer's, in turns.

torch's default group is "plait" (`dist.init_process_group("plait")`), the peer a second
group over the same ranks (`dist.new_group(backend="gloo")`, or "nccl" with --device
cuda), and a third group, gloo, is the referee: every timing starts at its barrier and its
max over ranks is taken on it, so neither compared group does bookkeeping and both start
from the same line. What each way runs is the same code (bench/wrapping.py's ddp and
fsdp2, the workload's SGD step, `dist.all_reduce`); only `process_group=` / the mesh's group
differs.

Each (workload, measure) builds its model once per way (a fresh copy from one seed),
warms each up, then the ways take turns (bench/turns.py, rotated): every round each way
trains --steps steps, on the same batches; a step's time is the slowest rank's, a round's
value the median of its steps. The latency is --calls back-to-back 16-byte all_reduces
per round, a round's value the slowest rank's median call, after one untimed round.

A way that raises (at set-up or in a round) stops there on every rank: the ranks agree on
it through the referee, its traceback is printed, and it is reported as failed with its
error, never as a figure; the other way goes on.
"""

from __future__ import annotations

import os
import statistics
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from plait.bench import gpu
from plait.bench.torch_backend.config import LATENCY_BYTES, TorchBackendBenchConfig
from plait.bench.turns import rotated, take_turns
from plait.bench.wrapping import Optim, wrap

T = TypeVar("T")
Timed = Callable[[int], float]  # round r -> the round's seconds


def run(config: TorchBackendBenchConfig) -> dict[str, Any] | None:
    """Measure every workload as one rank of the world; rank 0's figures (None on the rest)."""
    from plait.train import workloads

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("plait")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"plait": dist.group.WORLD, config.peer: dist.new_group(backend=config.peer)}
    referee = dist.new_group(backend="gloo")
    out: dict[str, Any] = {"world_size": size, "peer": config.peer, "torch": torch.__version__,
                           "workloads": {}}  # fmt: skip
    if device.type == "cuda":
        out["device"] = gpu.facts(device)
    if "latency" in config.measure_list:
        made = {way: _caller(g, config, referee, device) for way, g in groups.items()}
        label = f"{size} ranks, all_reduce {LATENCY_BYTES} B"
        out["latency"] = {"ways": _in_turns(label, made, config, referee, warmup=1)}
    for name in config.workload_list:
        work = workloads.build(name, config.global_batch, rank, size, seed=0)
        entry: dict[str, Any] = {"parameters": sum(p.numel() for p in work.model().parameters())}
        for measure in [m for m in ("ddp", "fsdp2") if m in config.measure_list]:
            label = f"{size} ranks, {name} {measure}"
            entry[measure] = _train(label, measure, work, groups, config, referee, device)
        out["workloads"][name] = entry
    dist.destroy_process_group()
    return out if rank == 0 else None


def _train(
    label: str, measure: str, work: Any, groups: dict[str, Any],
    config: TorchBackendBenchConfig, referee: Any, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """{"ways": each way's rounds (or why it failed), "max_param_diff": the largest
    difference between the ways' parameters after them (the same steps on the same
    batches: they differ only by the order of sums; or why it could not be taken)}."""
    made = {way: _attempt(referee, partial(_trainer, measure, work, g, config, referee, device))
            for way, g in groups.items()}  # fmt: skip
    rounds = {way: m if isinstance(m, str) else m[0] for way, m in made.items()}
    ways = _in_turns(label, rounds, config, referee)
    out: dict[str, Any] = {"ways": ways}
    models = [m[1] for way, m in made.items() if not isinstance(m, str) and "round_s" in ways[way]]
    if len(models) == 2:
        out["max_param_diff"] = _attempt(referee, lambda: _max_diff(*models))
    return out


def _trainer(
    measure: str, work: Any, group: Any, config: TorchBackendBenchConfig, referee: Any,
    device: torch.device,
) -> tuple[Timed, torch.nn.Module]:  # fmt: skip
    """`work`'s model wrapped by `measure` (ddp, fsdp2) over `group`, warmed up: its rounds,
    and the model."""
    sgd = Optim(torch.optim.SGD, {"lr": work.lr, "momentum": 0.9})
    model, opt = wrap(measure, work.model().to(device), sgd, group=group)

    def step(i: int) -> None:
        x, y = work.batch(i)
        opt.zero_grad(set_to_none=True)
        work.loss(model(x.to(device)), y.to(device)).backward()
        opt.step()

    _steps(step, 0, config.warmup, referee, device)

    def one_round(r: int) -> float:
        first = config.warmup + r * config.steps  # the same batches for every way
        return statistics.median(_steps(step, first, config.steps, referee, device))

    return one_round, model


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return float((_weights(a) - _weights(b)).abs().max().item())


def _weights(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters whole (an FSDP2 shard gathered: a collective on its group),
    flattened into one tensor on the CPU."""
    parts = []
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(whole.detach().reshape(-1).cpu())
    return torch.cat(parts)


def _caller(
    group: Any, config: TorchBackendBenchConfig, referee: Any, device: torch.device
) -> Timed:
    """A round of --calls 16-byte all_reduces on `group`: the slowest rank's median call."""
    t = torch.zeros(LATENCY_BYTES // 4, device=device)  # zeros: a sum of them stays 0

    def one_round(r: int) -> float:
        dist.barrier(group=referee)
        times = []
        for _ in range(config.calls):
            start = gpu.clock(device)
            dist.all_reduce(t, group=group)
            times.append(gpu.clock(device) - start)
        return _slowest([statistics.median(times)], referee)[0]

    return one_round


def _steps(
    step: Callable[[int], None], first: int, count: int, referee: Any, device: torch.device
) -> list[float]:
    """Seconds of steps first .. first + count - 1, each the slowest rank's; every rank
    starts each step at the referee's barrier."""
    mine = []
    for i in range(count):
        dist.barrier(group=referee)
        start = gpu.clock(device)
        step(first + i)
        mine.append(gpu.clock(device) - start)
    return _slowest(mine, referee)


def _slowest(seconds: list[float], referee: Any) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=referee)
    return [float(v) for v in t.tolist()]


def _attempt(referee: Any, fn: Callable[[], T]) -> T | str:
    """fn()'s value, or, where it raised on any rank, the first such rank's error (on every
    rank: they agree through the referee)."""
    value: T | None = None
    mine = None
    try:
        value = fn()
    except Exception as e:
        traceback.print_exc()
        mine = f"{type(e).__name__}: {e}"
    said: list[str | None] = [None] * dist.get_world_size(referee)
    dist.all_gather_object(said, mine, group=referee)
    errors = [f"rank {r}: {e}" for r, e in enumerate(said) if e is not None]
    if errors:
        return errors[0]
    assert value is not None
    return value


def _in_turns(
    label: str, made: Mapping[str, Timed | str], config: TorchBackendBenchConfig, referee: Any,
    warmup: int = 0,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """{way: {"round_s": [one value per round]}, or {"failed": why}}: the ways of `made`
    (a way's rounds, or why its set-up failed) in turns, `warmup` untimed rounds first."""
    failed = {way: m for way, m in made.items() if isinstance(m, str)}

    def one(way: str, r: int) -> float | None:
        timed = made[way]
        if way in failed or isinstance(timed, str):
            return None
        got = _attempt(referee, lambda: timed(r))
        if isinstance(got, str):
            failed[way] = got
            return None
        return got

    def progress(r: int, kept: dict[str, list[float | None]]) -> None:
        if dist.get_rank() == 0 and r >= warmup:
            ms = {way: "failed" if v[-1] is None else f"{v[-1] * 1e3:.2f}"
                  for way, v in kept.items()}  # fmt: skip
            print(f"{label}: round {r + 1 - warmup}/{config.repeats}, ms {ms}", flush=True)

    kept = take_turns(list(made), config.repeats, one, order=rotated, warmup=warmup,
                      after=progress)  # fmt: skip
    return {way: {"failed": failed[way]} if way in failed else {"round_s": kept[way]}
            for way in made}  # fmt: skip

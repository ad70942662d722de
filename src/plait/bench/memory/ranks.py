"""`plait bench memory`'s ranks: train one way (IMPL) and count the bytes each rank holds.

The parent (job.py) starts N ranks per way and world size, with the way as the extra
argument: one job each, so that each way's peak process memory (ru_maxrss) is its own.
Every rank builds the same gpt from one seed, wraps it (bench/wrapping.py), and trains
`warmup` untimed then `repeats` timed steps of AdamW on random tokens (the same global
batch at every world size). After the last optimizer step, before its
zero_grad, it counts the bytes of the parameters, gradients and optimizer state it holds
(`held`); rank 0 writes every rank's figures and the step times.

With --limit the rank first lowers its own RLIMIT_DATA to BYTES, checkpoints the blocks'
activations (so model states, not activations, decide what fits), and an allocation that
fails is reported as `rank R: out of memory ...` with exit status EXIT_OOM.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.bench.memory.config import EXIT_OOM, MemoryBenchConfig
from plait.bench.wrapping import Optim, Unavailable, wrap
from plait.comm.world import init, shutdown

LR = 1e-4
ADAMW = Optim(torch.optim.AdamW, {"lr": LR})


def build_model(config: MemoryBenchConfig) -> nn.Module:
    from plait.train.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(n_layer=config.layers, n_embd=config.width, n_head=config.heads,
                  block_size=config.seq)
    )  # fmt: skip


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of what this rank holds of `t` (a DTensor's local shard: FSDP2), or
    None where it holds nothing there: no bytes, or a tensor subclass without storage."""
    to_local = getattr(t, "to_local", None)
    try:
        storage = (to_local() if to_local is not None else t).untyped_storage()
        place = (storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass, a meta tensor
        return None
    return place if place[1] else None


def _shared_ranges() -> list[tuple[int, int]]:
    """This process's shared mappings ([start, end) addresses): memory its peers map too."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:  # "start-end perms offset dev inode [path]"; perms "rw-s": shared
            span, perms = line.split()[:2]
            if perms[3] == "s":
                start, end = span.split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def held(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds now, and of
    the other tensors Python can reach: "buffers" (DataParallel's buckets; not what torch
    holds in C++, like DDP's buckets) and "shared" (in shared memory, mapped by every rank
    on the host: plait's shared-memory segments).

    Counted by storage, each once, so a flat buffer and the views into it (a shard, a
    bucket view) count as the buffer: what the rank has allocated. The optimizer's 0-dim
    tensors (Adam's step counters, 4 bytes per parameter tensor) are left out, as the
    formulas leave them out: only per-element state counts.
    """
    seen: set[int] = set()

    def count(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            place = _storage(t) if isinstance(t, torch.Tensor) and t.dim() else None
            if place is not None and place[0] not in seen:
                seen.add(place[0])
                total += place[1]
        return total

    inner = getattr(model, "module", model)  # DataParallel, DDP and SDP keep it there
    params = [*model.parameters(), *inner.parameters()]
    # ShardedDataParallel keeps gradients outside .grad too: each unit's flat buffer
    flat_grads = [u.grads for u in getattr(model, "units", ())]
    local_opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    shared = _shared_ranges()

    def in_shared(t: torch.Tensor) -> bool:
        place = _storage(t)
        return place is not None and any(a <= place[0] < b for a, b in shared)

    return {
        "parameters": count(params),
        "gradients": count([*(p.grad for p in params), *flat_grads]),
        "optimizer": count(v for s in local_opt.state.values() for v in s.values()),
        "shared": count(t for t in alive if in_shared(t)),
        "buffers": count(alive),
    }


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failed: Python's MemoryError, torch's allocator, a thread's stack."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError)
        and any(s in text for s in ("allocate memory", "out of memory", "start new thread"))
    )


def train(config: MemoryBenchConfig, impl: str, rank: int, world: int) -> dict[str, Any]:
    """Train `impl` for warmup + repeats steps; this rank's figures."""
    model = build_model(config)
    psi = sum(p.numel() for p in model.parameters())
    if config.limit is not None:
        from plait.activations import checkpoint_blocks
        from plait.train.gpt import Block

        checkpoint_blocks(model, policy=lambda name, m: isinstance(m, Block))
    options = {"prefetch": config.prefetch} if impl.startswith("stage") else {}
    wrapped, opt = wrap(impl, model, ADAMW, **options)
    batch = config.global_batch // world
    times: list[float] = []
    counted: dict[str, int] = {}
    steps = config.warmup + config.repeats
    for step in range(steps):
        g = torch.Generator().manual_seed(step * world + rank)  # this rank's slice of step
        tokens = torch.randint(0, 256, (batch, config.seq + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]  # (batch, seq): next-token targets
        dist.barrier()
        start = time.perf_counter()
        logits = wrapped(x)  # (batch, seq, vocab)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        del logits  # not a buffer: `held` below counts every tensor still alive
        opt.step()
        if step == steps - 1:
            counted = held(wrapped, opt)  # after the step, before zero_grad: all held
        opt.zero_grad(set_to_none=True)
        if step >= config.warmup:
            times.append(time.perf_counter() - start)
    blocks = model.blocks
    assert isinstance(blocks, nn.Sequential)
    psi_block = sum(p.numel() for p in blocks[0].parameters())
    figures: dict[str, Any] = {"psi": psi, "psi_block": psi_block, **counted,
                               "peak_rss": peak_rss(), "step_s": times}  # fmt: skip
    memory = getattr(wrapped, "memory", None)  # ShardedDataParallel's own account
    if callable(memory):
        figures["sdp_memory"] = {k: v for k, v in memory().items() if isinstance(v, int)}
    return figures


def run(config: MemoryBenchConfig, impl: str) -> dict[str, Any] | None:
    """Train `impl` as one rank of the job; rank 0's figures (None on the others). Out of
    memory under --limit, the rank says so and exits with EXIT_OOM."""
    rank = int(os.environ.get("RANK", "0"))
    limit = config.limit_bytes
    if limit is not None:  # the soft limit only: any user may lower it (prlimit --data)
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        out = _run(config, impl)
    except BaseException as e:
        if limit is None or not is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"rank {rank}: out of memory under RLIMIT_DATA {limit} bytes "
            f"({limit / 2**20:.0f} MiB) training {impl}, {config.layers} layers: {first}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_OOM)  # no goodbye: the launcher stops the peers
    return out if rank == 0 else None


def _run(config: MemoryBenchConfig, impl: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    comm = init()
    start_rss = peak_rss()  # torch, gloo and plait before any model: every rank pays it
    try:
        mine: dict[str, Any] = {"start_rss": start_rss, **train(config, impl, comm.rank, comm.size)}
    except Unavailable as e:  # the same on every rank: nobody waits
        shutdown()
        return {"impl": impl, "world_size": comm.size, "unavailable": str(e)}
    ranks: list[Any] = [None] * comm.size
    dist.all_gather_object(ranks, mine)
    shutdown()
    return {"impl": impl, "world_size": comm.size, "ranks": ranks}

"""What `plait bench memory`'s tests count for themselves (tests/e2e/test_bench_memory.py,
tests/world/test_bench_memory_ranks.py)."""

from __future__ import annotations


def parameters(layers: int, width: int, heads: int, seq: int) -> int:
    """Ψ of the gpt the bench trains, counted from a fresh model."""
    from plait.train.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=heads, block_size=seq))
    return sum(p.numel() for p in gpt.parameters())

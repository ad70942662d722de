"""A small decoder-only transformer (GPT), laid out for later pipeline and tensor parallelism.

The layout is the contract later issues rely on:
- `blocks` is an `nn.Sequential` of identical `Block`s, so a pipeline can cut it into stages
  by slicing (`model.blocks[2:4]`), with the embeddings before and `ln_f` + `head` after.
- Every projection is a plain `nn.Linear` (attention has separate `q`, `k`, `v` and `out`;
  the MLP has `fc` and `proj`), so a tensor-parallel pass can swap `q`/`k`/`v`/`fc` for
  column-parallel layers and `out`/`proj` for row-parallel ones (Megatron-LM's split).
- Attention infers its number of heads from the width of `q`'s output
  (`out_features // head_dim`), so a rank that holds a column slice of `q`/`k`/`v` runs its
  share of the heads with no other change.
- `layers()` lists the model as [Embed, *blocks, Head], sharing its parameters, so that
  `plait.pipeline.Pipeline` can cut the whole model, embeddings and head included.
- The embedding and the output head are not tied: tied weights would bind the first and
  the last pipeline stage together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of the transformer."""

    vocab_size: int = 256
    block_size: int = 64  # the longest sequence (context) the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd {self.n_embd} % n_head {self.n_head} = "
                f"{self.n_embd % self.n_head} != 0: every head gets n_embd / n_head channels"
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.head_dim = c // config.n_head
        self.q = nn.Linear(c, c)
        self.k = nn.Linear(c, c)
        self.v = nn.Linear(c, c)
        self.out = nn.Linear(c, c)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (batch, seq, hidden)

        def heads(y: torch.Tensor) -> torch.Tensor:
            # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (batch, heads, seq, head_dim)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (batch, seq, heads * head_dim)
        return F.dropout(self.out(y), self.dropout, self.training)


class MLP(nn.Module):
    """The position-wise feed-forward layer: hidden -> 4 * hidden -> hidden."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, hidden) -> (batch, seq, 4 * hidden) -> (batch, seq, hidden)
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (batch, seq, hidden)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> next-token logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.n_layer)))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(_init_weights)
        # GPT-2: residual projections start smaller, so the residual stream's variance does
        # not grow with depth (each block adds two of them).
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.out, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = _embed(self, idx)  # (batch, seq, hidden)
        x = self.blocks(x)
        return self.head(self.ln_f(x))  # (batch, seq, vocab)

    def layers(self) -> list[nn.Module]:
        """The model as a list of layers whose composition is `forward`, for a pipeline:
        [Embed, *blocks, Head]. They share this model's parameters (no copies)."""
        return [Embed(self), *self.blocks, Head(self)]


class Embed(nn.Module):
    """GPT's first layer in `GPT.layers()`: ids (batch, seq) -> (batch, seq, hidden)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.config = gpt.config
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self, idx)


class Head(nn.Module):
    """GPT's last layer in `GPT.layers()`: (batch, seq, hidden) -> logits (batch, seq, vocab)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def _embed(m: GPT | Embed, idx: torch.Tensor) -> torch.Tensor:
    """Token ids (batch, seq) -> token + position embeddings (batch, seq, hidden)."""
    _, t = idx.shape
    if t > m.config.block_size:
        raise ValueError(f"sequence length {t} > block_size {m.config.block_size}")
    pos = torch.arange(t, device=idx.device)
    return m.drop(m.tok_emb(idx) + m.pos_emb(pos))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)

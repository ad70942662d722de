"""One unit's tensors: its parameters' flat full vector, this rank's shard, the gradient buffer.

Shapes, with P the unit's elements, padded to Q = S * N (layout.py), this rank r:

    full    (Q,)  every parameter of the unit end to end; the module's parameters are views
                  of it (`p.data = full[offset : offset + numel].view(shape)`), so a forward
                  reads it and nothing is copied into the module
    shard   (S,)  the nn.Parameter the optimizer steps: full[r*S : (r+1)*S]. In stages 1-2
                  it *is* that region (a view): stepping it updates this rank's part of
                  `full`, and the all-gather fills the other parts in place. In stage 3 it
                  is a tensor of its own, and `full` exists only while gathered
    grads   (Q,)  the gradients of the unit's parameters, laid out as `full` (the autograd
                  hook copies each p.grad in and drops it); reduce-scattered to (S,), the
                  average of this rank's part, which becomes `shard.grad`

Freeing `full` in stage 3 resizes its storage to zero instead of dropping the tensor: the
views autograd saved for backward (a linear layer keeps weight.t()) point at that storage,
so the all-gather before backward must refill the same storage (PyTorch FSDP's flat
parameter does the same), and freeing the storage is what really returns the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from plait.sharded.layout import Unit


class FlatUnit:
    """The tensors of one unit on one rank (see the module docstring)."""

    def __init__(
        self, unit: Unit, module: nn.Module | None, params: list[nn.Parameter], rank: int,
        world: int, stage: int, broadcast: Callable[[torch.Tensor], object],
    ) -> None:  # fmt: skip
        self.unit, self.module, self.params = unit, module, params
        self.rank, self.world = rank, world
        self.size = unit.shard_size(world)  # S
        padded = unit.padded(world)  # Q
        first = params[0]
        self.full = torch.zeros(padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for e, p in zip(unit.entries, params, strict=True):
                self.full[e.offset : e.offset + e.numel].copy_(p.detach().reshape(-1))
        broadcast(self.full)  # rank 0's values everywhere, a unit at a time (little memory)
        self._nbytes = self.full.untyped_storage().nbytes()
        for e, p in zip(unit.entries, params, strict=True):
            p.data = self.full[e.offset : e.offset + e.numel].view(e.shape)
        region = self.full[rank * self.size : (rank + 1) * self.size]
        self.shard = nn.Parameter(region.clone() if stage == 3 else region)
        if stage == 3:
            self.free()  # before the next unit is made: a model's worth is never held twice
        self.grads: torch.Tensor | None = None
        self.keep_grads = stage == 1  # `grads` stays from pass to pass
        self._written: set[int] = set()  # parameters whose gradient is in `grads`
        self._grad_shard: torch.Tensor | None = None
        self.pending = len(params)  # gradients still to land in this backward pass
        self.landed: set[int] = set()  # indices of the parameters whose gradient landed

    # ------------------------------------------------------------------- parameters
    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Return the full parameters' memory (stage 3); the views stay, empty."""
        self.full.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give `full` its storage back (its contents are undefined until gathered)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self._nbytes)

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """(i, start, stop): parameter i's part of this rank's shard is shard[start:stop];
        in shard order, and what no piece covers is padding (layout.py's `Unit.pieces`)."""
        index = {e.name: i for i, e in enumerate(self.unit.entries)}
        for piece in self.unit.pieces(self.rank, self.world):
            yield index[piece.entry.name], piece.at, piece.at + piece.hi - piece.lo

    def shard_in_full(self) -> torch.Tensor:
        return self.full[self.rank * self.size : (self.rank + 1) * self.size]

    @property
    def full_bytes(self) -> int:
        return self._nbytes

    # -------------------------------------------------------------------- gradients
    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Put parameter `index`'s gradient into the flat buffer: copied the first time in an
        accumulation, added after (the buffer is made empty: take_grads zeroes the rest)."""
        if self.grads is None:
            self.grads, self._written = self._empty(), set()
        if not self._written and self._aliased():  # a gradient kept from the last pass
            self.shard.grad = self.shard.grad.clone()  # type: ignore[union-attr]
        e = self.unit.entries[index]
        region = self.grads[e.offset : e.offset + e.numel]
        if index in self._written:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            self._written.add(index)

    def _empty(self) -> torch.Tensor:
        return torch.empty(self._nbytes // self.full.element_size(), dtype=self.full.dtype,
                           device=self.full.device)  # fmt: skip

    def take_grads(self) -> torch.Tensor:
        """The gradient buffer to reduce: zeros where no gradient landed (unused parameters,
        the padding). The next add_grad starts a new accumulation."""
        if self.grads is None:
            self.grads, self._written = self._empty(), set()
        for i, e in enumerate(self.unit.entries):
            if i not in self._written:
                self.grads[e.offset : e.offset + e.numel].zero_()
        self.grads[self.unit.numel :].zero_()
        self._written = set()
        return self.grads

    def set_shard_grad(self, reduced: torch.Tensor) -> None:
        """`reduced` (S,) is the average of this rank's part (in the parameters' dtype or a
        wire dtype, cast here): the shard's gradient, added to
        what the shard holds already (torch accumulates gradients until they are zeroed).
        Kept in one buffer across steps (set_to_none drops only the shard's reference); in
        stage 1, which keeps the whole gradient buffer, it is this rank's region of it."""
        if self.shard.grad is not None:
            self.shard.grad.add_(reduced)
            return
        if self.keep_grads:
            if reduced.dtype != self.shard.dtype:  # reduced in a wire dtype: back in place
                reduced = self.grads_in_shard().copy_(reduced)
            self.shard.grad = reduced  # a view of `grads`, which stays
            return
        if self._grad_shard is None:
            self._grad_shard = torch.empty_like(self.shard)
        self.shard.grad = self._grad_shard.copy_(reduced)

    def grads_in_shard(self) -> torch.Tensor:
        """This rank's (S,) region of the gradient buffer `grads` (stage 1 keeps it)."""
        assert self.grads is not None
        return self.grads[self.rank * self.size : (self.rank + 1) * self.size]

    def _aliased(self) -> bool:
        """Whether the shard's gradient is a region of `grads` (stage 1's, from a pass the
        user did not zero): the next pass would overwrite it."""
        g = self.shard.grad
        if g is None or self.grads is None:
            return False
        return g.untyped_storage().data_ptr() == self.grads.untyped_storage().data_ptr()

    def grad_bytes(self) -> int:
        """Bytes of gradient held: the buffer, and the shard's unless it is a region of it."""
        held = 0 if self.grads is None else self.grads.numel() * self.grads.element_size()
        g = self.shard.grad
        if g is not None and not self._aliased():
            held += g.numel() * g.element_size()
        return held

    def reset_pass(self) -> None:
        self.pending = len(self.params)
        self.landed.clear()

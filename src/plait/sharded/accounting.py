"""What a ShardedDataParallel holds: the bytes of its model states now, and stage 3's most
gathered at once (`ShardedDataParallel.memory`, `peak_gathered`)."""

from __future__ import annotations

from plait.sharded.flat import FlatUnit


class Accounting:
    """The memory of one rank's units (`root`: the index of the root unit, if any)."""

    def __init__(self, units: list[FlatUnit], root: int | None, stage: int, prefetch: int) -> None:
        self.units, self.root, self.stage, self.prefetch = units, root, stage, prefetch
        self.peak_gathered = 0  # the most non-root units gathered at once (stage 3)
        self.peak_gathered_bytes = 0  # ... and their bytes, with the root's

    def count(self) -> None:
        """Note what is gathered now (stage 3: called as each all-gather starts)."""
        if self.stage != 3:
            return
        held = [u for u, f in enumerate(self.units) if f.gathered]
        blocks = [u for u in held if u != self.root]
        self.peak_gathered = max(self.peak_gathered, len(blocks))
        self.peak_gathered_bytes = max(
            self.peak_gathered_bytes, sum(self.units[u].full_bytes for u in held)
        )

    def report(self) -> dict[str, int]:
        """Bytes of model states this rank holds now (see ShardedDataParallel.memory)."""
        fulls = [f.full_bytes if f.gathered else 0 for f in self.units]
        shards = sum(f.shard.numel() * f.shard.element_size() for f in self.units)
        params = sum(fulls) + (shards if self.stage == 3 else 0)
        grads = sum(f.grad_bytes() for f in self.units)
        blocks = sorted((f.full_bytes for u, f in enumerate(self.units) if u != self.root),
                        reverse=True)  # fmt: skip
        root = 0 if self.root is None else self.units[self.root].full_bytes
        return {
            "parameters": params,
            "gradients": grads,
            "gathered_peak": self.peak_gathered_bytes if self.stage == 3 else sum(fulls),
            "largest_units": root + sum(blocks[: self.prefetch + 1]),
        }

"""ShardedDataParallel: data parallelism where each of N ranks keeps 1/N of the model states.

ZeRO (Rajbhandari et al., SC'20), per stage, with Ψ parameters and fp32 Adam (bytes/rank):

    stage 1   optimizer state sharded                      8Ψ + 8Ψ/N   (DDP: 16Ψ)
    stage 2   + gradients reduce-scattered in backward      4Ψ + 12Ψ/N
    stage 3   + parameters sharded, gathered per unit       16Ψ/N + the gathered units

The optimizer is any torch optimizer that updates elements independently (SGD, Adam,
AdamW, ...) built on `sdp.parameters()`: one flat shard (S,) per unit (flat.py). A step:

    forward     stage 1-2: after a step, each unit's shard is all-gathered in place into its
                full vector (launched together at the start, each awaited just before the
                unit runs). Stage 3: the root unit is gathered first; each unit is gathered
                before its forward (pre-hook), the next `prefetch` ones are started
                meanwhile, and it is freed after (unless reshard_after_forward=False)
    backward    stage 3: a hook on a unit's outputs gathers it again before its backward
                and prefetches the units backward reaches next. Each parameter's gradient is
                copied into its unit's flat buffer; once a unit's are all in, the buffer is
                reduce-scattered (average) while backward goes on: in a fixed order, the
                same on every rank, as DataParallel's buckets. Stage 3 frees the unit then
    end         (autograd callback) wait for the reductions: each becomes its shard's .grad
    step        optimizer.step() on the shards; then `clip_grad_norm_` if needed before it

Collectives are matched by issue order, and every rank issues them in the order its forward
and backward run, which is the same on every rank for the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.data_parallel import replicas
from plait.data_parallel.dp import UnusedParametersError
from plait.sharded import state
from plait.sharded import units as unit_choice
from plait.sharded.flat import FlatUnit
from plait.sharded.layout import Layout
from plait.trace.recorder import waited

STAGES = (1, 2, 3)
# Stages 2-3: reductions in flight at most, each holding its unit's whole gradient buffer
# until done; waiting for the oldest keeps ~IN_FLIGHT units' worth alive instead of 4Ψ.
IN_FLIGHT = 2


class ShardedDataParallel(nn.Module):
    """Wrap `module` for sharded data parallelism (ZeRO stage 1, 2 or 3) over `comm`.

    Args:
        module: the model, on one device; every rank must pass the same architecture.
        stage: 1, 2 or 3 (see the module docstring).
        comm: the Communicator whose ranks share the work (`plait.init()` if None).
        units: the blocks sharded together: None (the repeated blocks), module names, or a
            policy `(name, module) -> bool`. Everything else is the root unit.
        prefetch: stage 3: units whose all-gather is started ahead of the one running.
        reshard_after_forward: stage 3: free a unit's parameters after its forward (and
            gather it again for backward); False keeps them until the end of backward.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        find_unused_parameters: reduce a parameter that got no gradient on this rank as
            zeros (False: raise UnusedParametersError naming it).

    Raises:
        ReplicaMismatchError: on every rank, if the ranks' parameters differ.
        ValueError: a bad stage, prefetch or units, or parameters on several devices.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int = 3,
        comm: Communicator | None = None,
        units: unit_choice.UnitChoice = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        mixed_precision: Any = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        if stage not in STAGES or isinstance(stage, bool):
            raise ValueError(f"stage must be 1, 2 or 3; got {stage!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
        if mixed_precision is not None:
            raise NotImplementedError(
                "ShardedDataParallel(mixed_precision=...) is not built yet: run the forward "
                "under torch.autocast (plait train --precision bf16) for low-precision compute"
            )
        if comm is None:
            import plait

            comm = plait.init()
        self.module, self.comm, self.stage = module, comm, stage
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters

        placed = sorted({str(p.device) for p in module.parameters()})
        if len(placed) > 1:
            raise ValueError(
                f"ShardedDataParallel shards a module on one device; its parameters are on "
                f"{', '.join(placed)}: move it first, module.to(device)"
            )
        replicas.check_same(comm, list(module.named_parameters()) + list(module.named_buffers()))
        assigned = unit_choice.assign(module, unit_choice.choose(module, units))
        self.layout: Layout = unit_choice.layout_of(assigned)
        sharded = {id(p) for _, _, params in assigned for _, p in params}
        replicas.broadcast_tensors(  # the rest; each unit's parameters as its flat vector
            comm, [t for t in module.state_dict(keep_vars=True).values() if id(t) not in sharded]
        )
        share = lambda full: comm.broadcast_(full, root=0) if comm.size > 1 else None  # noqa: E731
        self.units = [
            FlatUnit(u, m, [p for _, p in params], comm.rank, comm.size, stage, share)
            for u, (_, m, params) in zip(self.layout.units, assigned, strict=True)
        ]
        self._root = next((i for i, u in enumerate(self.units) if u.module is None), None)
        self._order: list[int] | None = None  # units in the order forward runs them
        self._recording: list[int] = []
        self._gathers: dict[int, Request[torch.Tensor]] = {}
        self._reductions: dict[int, Request[torch.Tensor]] = {}  # in flight, launch order
        self._launched: set[int] = set()  # this pass's units whose reduction started
        self._launch: list[int] = []  # this pass's reduction order
        self._next = 0
        self._sync = True
        self._in_backward = False
        self._backward_seen: set[int] = set()
        self._stale = False  # stages 1-2: a step may have changed the shards since the gather
        self._checked_gathers = self._checked_reductions = self._checked_buffers = False
        self.peak_gathered = 0  # the most non-root units gathered at once (stage 3)
        self.peak_gathered_bytes = 0  # ... and their bytes, with the root's
        self._hooks: list[Any] = []
        for u, flat in enumerate(self.units):
            for i, p in enumerate(flat.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(u, i)))
            if flat.module is not None:
                self._hooks.append(flat.module.register_forward_pre_hook(self._pre_forward(u)))
                self._hooks.append(flat.module.register_forward_hook(self._post_forward(u)))

    # ---------------------------------------------------------------- public
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's shards, one flat (S,) parameter per unit ("shards.{unit}"): the
        optimizer's parameters. (The module's own parameters are views ShardedDataParallel
        manages.)"""
        for u, flat in enumerate(self.units):
            yield f"{prefix}{'.' if prefix else ''}shards.{u}", flat.shard

    @property
    def shards(self) -> list[nn.Parameter]:
        return [flat.shard for flat in self.units]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            self._checked_buffers |= replicas.broadcast_buffers(
                self.comm, self.module, check=not self._checked_buffers
            )
        if self.stage < 3 and self._stale:
            for u in self._forward_order():  # every unit's gather, awaited unit by unit
                self._start_gather(u)
            self._stale = False
        if self._root is not None:
            self._ensure(self._root)
        if self._order is None:
            self._recording = []
        elif self.stage == 3:
            for u in self._order[: self.prefetch]:
                self._start_gather(u)
        out = self.module(*args, **kwargs)
        if self._order is None:  # units forward did not run go last, in layout order
            ran = list(dict.fromkeys(self._recording))
            self._order = ran + [
                u for u in range(len(self.units)) if u not in ran and u != self._root
            ]
        if self.stage == 3 and not torch.is_grad_enabled():
            self._free_all()
        for u in list(self._gathers):  # stage 1-2 gathers of units that did not run
            self._ensure(u)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (in full, per unit); the first backward after the
        block reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The unwrapped module's state_dict, whole, on every rank (a collective: it gathers
        each unit in turn). For checkpoints that stay sharded see plait.sharded.checkpoint."""
        return state.full_state_dict(self)

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a whole state_dict of the unwrapped module (every rank passes the same)."""
        return state.load_full_state_dict(self, state_dict, strict)

    @contextlib.contextmanager
    def gathered(self, u: int, write: bool = False) -> Iterator[None]:
        """Unit u's full parameters, whole in `units[u].full` for the block (a collective in
        stage 3, and in stages 1-2 after a step). `write`: what the block writes into
        `full` is kept (copied into the shard)."""
        self._finish_gathers()
        flat = self.units[u]
        was = flat.gathered
        self._ensure(u)
        try:
            yield
        finally:
            if write and self.stage == 3:
                with torch.no_grad():
                    flat.shard.copy_(flat.shard_in_full())
            if self.stage == 3 and not was:
                flat.free()

    def refresh(self) -> None:
        """The shards were written directly (a checkpoint loaded into them): the full
        parameters are gathered again before they are next used."""
        self._stale = self.stage < 3

    def _finish_gathers(self) -> None:
        """Stages 1-2: bring every unit up to date after a step (before reading `full`)."""
        if self.stage < 3 and self._stale:
            for u in self._forward_order():
                self._start_gather(u)
            self._stale = False
        for u in list(self._gathers):
            self._ensure(u)

    def memory(self) -> dict[str, int]:
        """Bytes of model states this rank holds now (without the optimizer's: count those
        from its state), and stage 3's most gathered at once.

        Keys: "parameters" (shards, and the full vectors held: all of them in stages 1-2,
        where a shard is a view into its unit's), "gradients" (the shards' and the flat
        buffers held), "gathered_peak" (stage 3: the most bytes of full parameters held at
        once so far), "largest_units" (the root's and the largest prefetch + 1 units' full
        parameters: what stage 3 may hold at once).
        """
        fulls = [f.full_bytes if f.gathered else 0 for f in self.units]
        shards = sum(f.shard.numel() * f.shard.element_size() for f in self.units)
        params = sum(fulls) + (shards if self.stage == 3 else 0)
        grads = sum(f.grad_bytes() for f in self.units)
        blocks = sorted((f.full_bytes for u, f in enumerate(self.units) if u != self._root),
                        reverse=True)  # fmt: skip
        root = 0 if self._root is None else self.units[self._root].full_bytes
        return {
            "parameters": params,
            "gradients": grads,
            "gathered_peak": self.peak_gathered_bytes if self.stage == 3 else sum(fulls),
            "largest_units": root + sum(blocks[: self.prefetch + 1]),
        }

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients so that the whole gradient's norm is at most
        `max_norm` (torch.nn.utils.clip_grad_norm_ over all ranks' shards); returns the
        norm before clipping. A collective: every rank calls it. Padding is zeros."""
        return state.clip_grad_norm_([f.shard for f in self.units], self.comm, max_norm,
                                     norm_type)  # fmt: skip

    # ----------------------------------------------------------- gathering (forward)
    def _forward_order(self) -> list[int]:
        order = self._order if self._order is not None else range(len(self.units))
        first = [] if self._root is None else [self._root]
        return first + [u for u in order if u != self._root]

    def _start_gather(self, u: int) -> None:
        """Start unit u's all-gather unless it is gathered or on its way (stage 3), or
        start it regardless (stages 1-2: its shard changed)."""
        flat = self.units[u]
        if u in self._gathers or (self.stage == 3 and flat.gathered):
            return
        flat.allocate()
        source = flat.shard.detach() if self.stage == 3 else flat.shard_in_full()
        self._gathers[u] = self.comm.allgather_async(
            source, out=flat.full, check=not self._checked_gathers
        )
        self._count_gathered()

    def _ensure(self, u: int) -> None:
        """Unit u's full parameters, gathered (waiting for its all-gather if started)."""
        if self.stage == 3:
            self._start_gather(u)
        request = self._gathers.pop(u, None)
        if request is not None:  # (traced: the wait blocks the computing thread)
            waited(request, self.comm.recorder, "allgather", self.comm.label)
            self._checked_gathers = True

    def _count_gathered(self) -> None:
        if self.stage != 3:
            return
        held = [u for u, f in enumerate(self.units) if f.gathered]
        blocks = [u for u in held if u != self._root]
        self.peak_gathered = max(self.peak_gathered, len(blocks))
        self.peak_gathered_bytes = max(
            self.peak_gathered_bytes, sum(self.units[u].full_bytes for u in held)
        )

    def _free(self, u: int) -> None:
        if self.stage == 3 and u != self._root and u not in self._gathers:
            self.units[u].free()

    def _free_all(self) -> None:
        for u in list(self._gathers):
            self._ensure(u)
        if self.stage == 3:
            for flat in self.units:
                flat.free()

    def _next_units(self, u: int, order: list[int]) -> list[int]:
        at = order.index(u) if u in order else len(order)
        return order[at + 1 : at + 1 + self.prefetch]

    def _pre_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._order is None:
                self._recording.append(u)
            self._ensure(u)
            if self.stage == 3 and self._order is not None:
                for nxt in self._next_units(u, self._order):
                    self._start_gather(nxt)

        return hook

    def _post_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.stage != 3:
                return
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0]
                           if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
                for t in tensors:
                    t.register_hook(self._pre_backward(u))
            if not torch.is_grad_enabled():
                self._free(u)
            elif self.reshard_after_forward and not (self._order and u == self._order[-1]):
                # (the last unit's backward comes next: freeing it would gather it again at
                # once, as DeepSpeed's reuse distance keeps parameters needed soon)
                self._free(u)

        return hook

    # --------------------------------------------------------- reducing (backward)
    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        order = self._order if self._order is not None else list(range(len(self.units)))
        self._launch = [u for u in reversed(order) if u != self._root]
        if self._root is not None:
            self._launch.append(self._root)
        self._next = 0
        # runs when the whole backward pass is done, in the thread that ran it
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _pre_backward(self, u: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            if u in self._backward_seen:
                return
            self._backward_seen.add(u)
            self._ensure(u)
            backward_order = [v for v in self._launch if v != self._root]
            for nxt in self._next_units(u, backward_order):
                self._start_gather(nxt)

        return hook

    def _grad_hook(self, u: int, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._begin_backward()
            flat = self.units[u]
            if param.grad is None or (i in flat.landed and u in self._launched):
                return  # a second gradient after the unit's reduction started: reduced once
            flat.add_grad(i, param.grad)
            param.grad = None
            if i not in flat.landed:
                flat.landed.add(i)
                flat.pending -= 1
            if flat.pending == 0:
                self._free(u)
                if self._sync:
                    self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self._launch) and self.units[self._launch[self._next]].pending == 0:
            u = self._launch[self._next]
            flat = self.units[u]
            # in the buffer itself (no copy); stage 1 keeps it, later stages let it go
            self._reductions[u] = self.comm.reduce_scatter_async_(
                flat.take_grads(), op="avg", check=not self._checked_reductions
            )
            self._launched.add(u)
            if self.stage > 1:
                flat.grads = None  # the request holds it until reduced
            self._next += 1
            if self.stage > 1:  # bound the buffers alive: wait for the oldest reductions
                while len(self._reductions) > IN_FLIGHT:
                    self._take_oldest()

    def _take_oldest(self) -> None:
        u, request = next(iter(self._reductions.items()))
        del self._reductions[u]
        rec = self.comm.recorder
        self.units[u].set_shard_grad(waited(request, rec, "reduce_scatter", self.comm.label))

    def _finish(self) -> None:
        try:
            missing = [
                self.layout.units[u].entries[i].name
                for u, flat in enumerate(self.units)
                for i in range(len(flat.params))
                if i not in flat.landed
            ]
            if self._sync:
                # launch and wait for every unit even when about to raise: the other ranks
                # reduce them all, and this rank's communicator must stay in step with theirs
                for flat in self.units:
                    flat.pending = 0
                self._launch_ready()
                while self._reductions:
                    self._take_oldest()
                self._checked_reductions = True
                self._stale = self.stage < 3
            self._free_all()
            if missing and self._sync and not self.find_unused_parameters:
                raise UnusedParametersError(
                    f"{len(missing)} parameter(s) got no gradient on rank {self.comm.rank} in "
                    f"this backward pass: {', '.join(missing)}. Pass ShardedDataParallel(..., "
                    "find_unused_parameters=True) to reduce them as zeros where unused, "
                    "or set requires_grad=False on parameters the model never uses."
                )
        finally:
            for flat in self.units:
                flat.reset_pass()
            self._reductions.clear()
            self._launched.clear()
            self._backward_seen.clear()
            self._in_backward = False

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

The wrapper holds the units and wires the hooks; the work is three collaborators'
(FSDP2 keeps its parameter groups' parts apart the same way): gather_schedule.py (when each
unit is gathered, awaited and freed), grad_queue.py (the gradients' reduce-scatters, in
order) and accounting.py (the bytes held).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.comm.communicator import Communicator
from plait.comm.world import init
from plait.data_parallel import compression as compressing
from plait.data_parallel import replicas
from plait.data_parallel.dp import UnusedParametersError
from plait.sharded import state
from plait.sharded import units as unit_choice
from plait.sharded.accounting import Accounting
from plait.sharded.flat import FlatUnit
from plait.sharded.gather_schedule import GatherSchedule
from plait.sharded.grad_queue import GradQueue
from plait.sharded.layout import Layout

STAGES = (1, 2, 3)


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
        compression: how the gradients cross the wire: "none", or "fp16"/"bf16" (each
            unit's buffer reduce-scattered in that dtype, as DataParallel's compression of
            that name sends its buckets); `reduce_dtype` is the same by its other name.

    Raises:
        ReplicaMismatchError: on every rank, if the ranks' parameters differ.
        ValueError: a bad stage, prefetch or units, or parameters on several devices.
        ConfigError (a ValueError): a compression a reduce-scatter cannot carry.
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
        compression: str | compressing.Compressor | None = None,
        reduce_dtype: torch.dtype | None = None,
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
        self.compression = compressing.make(compression, reduce_dtype)
        compressing.check_sharded(self.compression)
        if comm is None:
            comm = init()
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
        # three collaborators, as FSDP2 keeps its parameter groups' parts apart: when units
        # are gathered and freed, the queue of gradient reductions, what is held
        root = next((i for i, u in enumerate(self.units) if u.module is None), None)
        self._accounting = Accounting(self.units, root, stage, prefetch)
        self._gathers = GatherSchedule(self.units, root, comm, stage, prefetch,
                                       reshard_after_forward, self._accounting)  # fmt: skip
        self._grads = GradQueue(self.units, comm, stage, self.compression.wire_dtype)
        self._checked_buffers = False
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

    @property
    def peak_gathered(self) -> int:
        """Stage 3: the most units (besides the root) gathered at once so far."""
        return self._accounting.peak_gathered

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most bytes of full parameters gathered at once so far, the root's too."""
        return self._accounting.peak_gathered_bytes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            self._checked_buffers |= replicas.broadcast_buffers(
                self.comm, self.module, check=not self._checked_buffers
            )
        self._gathers.before_forward()
        out = self.module(*args, **kwargs)
        self._gathers.after_forward()
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (in full, per unit); the first backward after the
        block reduces them."""
        previous, self._grads.sync = self._grads.sync, False
        try:
            yield
        finally:
            self._grads.sync = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The unwrapped module's state_dict, whole, on every rank (a collective: it gathers
        each unit in turn). For checkpoints that stay sharded see plait.sharded.checkpoint."""
        return state.full_state_dict(self)

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a whole state_dict of the unwrapped module (every rank passes the same)."""
        return state.load_full_state_dict(self, state_dict, strict)

    def gathered(self, u: int, write: bool = False) -> contextlib.AbstractContextManager[None]:
        """Unit u's full parameters, whole in `units[u].full` for the block (a collective in
        stage 3, and in stages 1-2 after a step). `write`: what the block writes into
        `full` is kept (copied into the shard)."""
        return self._gathers.whole(u, write)

    def refresh(self) -> None:
        """The shards were written directly (a checkpoint loaded into them): the full
        parameters are gathered again before they are next used."""
        self._gathers.stale = self.stage < 3

    def release(self) -> nn.Module:
        """Let go of the module (an elastic job re-lays the shards over a new membership):
        the hooks removed, each sharded parameter a tensor of its own again, its contents
        undefined (stage 3 had freed them: the caller writes them). Returns the module, to
        be wrapped anew; this wrapper must not be used after."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for flat in self.units:
            for e, p in zip(flat.unit.entries, flat.params, strict=True):
                p.data = torch.empty(e.shape, dtype=p.dtype, device=p.device)
        return self.module

    def memory(self) -> dict[str, int]:
        """Bytes of model states this rank holds now (without the optimizer's: count those
        from its state), and stage 3's most gathered at once.

        Keys: "parameters" (shards, and the full vectors held: all of them in stages 1-2,
        where a shard is a view into its unit's), "gradients" (the shards' and the flat
        buffers held), "gathered_peak" (stage 3: the most bytes of full parameters held at
        once so far), "largest_units" (the root's and the largest prefetch + 1 units' full
        parameters: what stage 3 may hold at once).
        """
        return self._accounting.report()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients so that the whole gradient's norm is at most
        `max_norm` (torch.nn.utils.clip_grad_norm_ over all ranks' shards); returns the
        norm before clipping. A collective: every rank calls it. Padding is zeros."""
        return state.clip_grad_norm_([f.shard for f in self.units], self.comm, max_norm,
                                     norm_type)  # fmt: skip

    # ------------------------------------------------------------------ the hooks
    def _pre_forward(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._gathers.before_unit(u)

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
            self._gathers.after_unit(u)

        return hook

    def _begin_backward(self) -> None:
        """The first hook of a backward pass: the reductions' order is backward's, the root
        last (it holds what forward ran first and backward reaches last)."""
        if self._grads.in_backward:
            return
        order = self._gathers.backward_order()
        if self._gathers.root is not None:
            order.append(self._gathers.root)
        self._grads.begin(order, self._end_backward)

    def _pre_backward(self, u: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            self._gathers.before_backward(u)

        return hook

    def _grad_hook(self, u: int, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._begin_backward()
            if self._grads.add(u, i, param):
                self._gathers.free(u)
                self._grads.launch_ready()

        return hook

    def _end_backward(self) -> None:
        """The whole backward pass is done: every reduction waited for, each shard's .grad
        set; the units freed (stage 3) or due for a gather after the step (stages 1-2)."""
        sync = self._grads.sync
        try:
            missing = self._grads.missing()
            if sync:
                self._grads.drain()
                self._gathers.stale = self.stage < 3
            self._gathers.free_all(keep_root=not sync)
            if missing and sync and not self.find_unused_parameters:
                raise UnusedParametersError(
                    f"{len(missing)} parameter(s) got no gradient on rank {self.comm.rank} in "
                    f"this backward pass: {', '.join(missing)}. Pass ShardedDataParallel(..., "
                    "find_unused_parameters=True) to reduce them as zeros where unused, "
                    "or set requires_grad=False on parameters the model never uses."
                )
        finally:
            self._grads.end_pass()
            self._gathers.end_pass()

"""What a Step does around its model's arithmetic: --activation-checkpointing, --compile,
--precision (autocast, fp16's loss scaling) and --reduce-dtype/--compression, in one object
each Step holds (`Compute`), so that every strategy applies them in the same order:

    checkpoint(model)    the whole model, before a pipeline cuts it (plait.checkpoint_blocks)
    wrap(module)         what this rank runs (the model, or its pipeline stage): compiled,
                         with autocast around it; DataParallel goes around that, with
                         `compression` for its buckets (--compression, or --reduce-dtype)
    forward_backward     the loss, scaled for backward (fp16); the first call counts the
                         bytes autograd keeps for backward, the most at once through its
                         backward (plait.saved_tensors; not with --compile: a compiled
                         graph saves its tensors out of the counting hooks' sight)
    unscale_, step       before clipping; the optimizer step, skipped on an fp16 overflow

With every option at its default each of these is the identity, and the arithmetic is the
eager fp32 one of before, bit for bit (scripts/parity.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait import saved_tensors, trace
from plait.activations import blocks_worth_checkpointing, checkpoint_blocks
from plait.comm.communicator import Communicator
from plait.saved_tensors import SavedBytes
from plait.sharded import ShardedDataParallel
from plait.train import compile, precision
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.workload import LossFn


class Compute:
    """One rank's settings of how its model computes, and their figures.

    Args:
        comm: the ranks whose gradients differ and must agree on skipping an fp16 step (a
            mesh's); None where DataParallel leaves every rank the same gradients.
        recorder: the trace's recorder (`comm.recorder` of the run's communicator), if any.
    """

    def __init__(
        self,
        config: TrainConfig,
        device: torch.device,
        comm: Communicator | None = None,
        recorder: trace.Recorder | None = None,
    ) -> None:
        self.options = c = config.compute
        self.recorder = recorder  # plait.trace's, while a trace records
        self.device = device
        low = c.precision != "fp32"
        self.dtype = precision.dtype(c.precision) if low else None
        self.compression = c.wire  # DataParallel's: "none", "bf16", "topk:0.01", ...
        self.scaler = precision.LossScaler(c.loss_scale, comm) if c.precision == "fp16" else None
        self.blocks: list[str] = []  # the checkpointed blocks' names
        self._saved: SavedBytes | None = None  # what the first step kept for backward
        if c.compile:
            compile.check(device.type)

    @property
    def activation_bytes(self) -> int | None:
        """The most bytes autograd held at once for the first step (None before it, or
        with --compile): its forward's, or more while backward recomputes a block."""
        return None if self._saved is None else self._saved.peak

    def checkpoint(self, model: nn.Module) -> None:
        """--activation-checkpointing: checkpoint the model's repeated blocks in place.

        Raises:
            ConfigError: the model has no repeated blocks.
        """
        if not self.options.activation_checkpointing:
            return
        try:
            blocks_worth_checkpointing(model)
        except ValueError as e:
            raise ConfigError(f"--activation-checkpointing: {e}") from None
        self.blocks = checkpoint_blocks(model)

    def wrap(self, module: nn.Module, layers: list[nn.Module] | None = None) -> nn.Module:
        """`module` as this rank runs it: compiled (--compile), under autocast in the run's
        precision (--precision); `module` itself, its names and state_dict, unchanged.

        Compiled in pieces where hooks must stay outside every graph, each piece's forward
        on its own (torchtitan compiles each block under FSDP2 for the same reason):
        - a ShardedDataParallel (--zero): each unit (the model whole when it is one root
          unit). Its hooks gather a unit's parameters before it runs and reduce-scatter its
          gradients after, collectives no graph may hold; what belongs to no unit (a
          transformer's embeddings and head) runs eager;
        - `layers`: a zb-h1 stage's, whose hooks cut the graph at each layer (split.py).
        """
        pieces = layers
        if isinstance(module, ShardedDataParallel):
            units = [flat.module for flat in module.units if flat.module is not None]
            pieces = units or [module.module]
        if self.options.compile and pieces is not None:
            for piece in pieces:  # (a zb-h1 layer's backward runs twice: B keeps its graph)
                compile_forward(piece, retain_graph=layers is not None)
        elif self.options.compile:
            module = Compiled(module)
        if self.dtype is not None:
            module = precision.Autocast(module, self.device.type, self.dtype)
        return module

    def forward_backward(
        self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        """Forward (x, y) through `module` (wrapped), backward the (scaled) loss; return the
        loss, unscaled and detached. While a trace records: a "forward" and a "backward"
        event (the latter ends where DataParallel's end-of-backward wait begins)."""
        rec = self.recorder
        if rec is None:
            loss = self._forward(module, x, y, loss_fn)
            self.scaled(loss).backward()
            return loss.detach()
        t0 = trace.now()
        loss = self._forward(module, x, y, loss_fn)
        t1 = trace.now()
        rec.backward_end = None
        self.scaled(loss).backward()
        t2 = trace.now()
        end = rec.backward_end if rec.backward_end is not None and rec.backward_end > t1 else t2
        rec.complete("compute", "forward", t0, t1)
        rec.complete("compute", "backward", t1, end)
        return loss.detach()

    def _forward(
        self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        if self._saved is None and not self.options.compile:  # once: shapes repeat
            # counted on through this step's backward: its figures keep moving until then
            with saved_tensors.counting() as self._saved:
                return loss_fn(module(x), y)
        return loss_fn(module(x), y)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: times the loss scale with fp16."""
        return loss if self.scaler is None else self.scaler.scaled(loss)

    def scaled_loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn` with its value scaled, for a pipeline that runs backward itself;
        `unscaled` turns what it returns back into the loss."""
        if self.scaler is None:
            return loss_fn
        return lambda output, target: self.scaled(loss_fn(output, target))

    def unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else loss / self.scaler.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients as the loss's, not the scaled loss's."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; with fp16, skipped when the gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def figures(self) -> dict[str, Any]:
        """The --json figures of these options (parts_compute.rows prints them)."""
        c, s = self.options, self.scaler
        return {
            "precision": c.precision, "reduce_dtype": c.reduce_dtype, "compression": c.wire,
            "loss_scale": s.scale if s is not None else None,
            "skipped_steps": s.skipped if s is not None else 0,
            "checkpointed_blocks": self.blocks, "activation_bytes": self.activation_bytes,
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint's part of these: the loss scaler's state (fp16), else nothing."""
        return {} if self.scaler is None else {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


class Compiled(nn.Module):
    """`module` with its forward compiled by torch.compile.

    The bound forward is compiled, not the module: `module.compile()` compiles
    `nn.Module._call_impl`, a frame torch 2.13 skips when the forward is torch's own (an
    `nn.Sequential`: mlp, cnn, wide, every pipeline stage ran eager, silently), and
    `torch.compile(module)` registers the module a second time, under `_orig_mod`.

    It runs with identity saved-tensor hooks in place of the caller's: the pipeline counts
    what autograd saves with hooks (pipeline/stats.py) that torch.compile cannot trace, so
    the count misses what the compiled graph saves.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.compiled = CompiledForward(module.forward)  # a function: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


class CompiledForward:
    """A module's bound `forward`, compiled by torch.compile, run with identity
    saved-tensor hooks in place of the caller's (see `Compiled`).

    `retain_graph`: its backward may run twice (zb-h1's B keeps the graph for W). AOTAutograd
    then must not donate the saved tensors' buffers to the backward, which it does by
    default and which raises on a retained graph. The setting is the process's, read when
    a backward is compiled (lazily, at its first run): turned off for good here, which
    costs the other graphs only that reuse of memory."""

    def __init__(self, forward: Any, retain_graph: bool = False) -> None:
        if retain_graph:
            import torch._functorch.config as aot_config  # (not loaded by `import torch`)

            aot_config.donated_buffer = False
        self.compiled = torch.compile(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return self.compiled(*args, **kwargs)


def compile_forward(module: nn.Module, retain_graph: bool = False) -> None:
    """Compile `module`'s forward in place (its hooks stay outside the graph); once."""
    if not isinstance(module.forward, CompiledForward):
        module.forward = CompiledForward(module.forward, retain_graph)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t

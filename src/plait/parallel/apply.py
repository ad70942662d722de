"""`apply(model, plan, comm)`: run a per-layer plan (layout.LayerPlan) over the plan's ranks.

Every rank builds the full model (the same seed) and keeps its part of each layer:

    data     the layer, replicated (broadcast from rank 0 once): each rank its rows
    column   an nn.Linear of this rank's rows of the weight (output features) and bias
    row      this rank's columns of the weight (input features), the bias added on rank 0
             alone (`RowLinear`)
    split    `tensor_parallel.parallelize(layer, comm)`: Megatron's split (full in, full out)
    rank:R   the layer on rank R; the others a `Placeholder` (no parameters) that runs the
             layer on the meta device, so that every rank knows the shapes R's tensors have
    follow   the layer as it is (a Placeholder where it runs on another rank alone)

`forward(x)` takes this rank's rows of the batch, runs each layer in its layout
(`resolve`) with the conversions (convert.py) between, and returns this rank's rows of the
output: the loss is then the data-parallel one (each rank the mean over its rows).

Gradients (layout.py's docstring): each rank backpropagates its own loss, so every gradient
is W times the global batch's mean loss's. The "sum" parameters (a data layer's, a row
layer's bias) hold each rank's share: one bucket per layer, whose allreduce starts (async)
as soon as the last of the layer's gradients is accumulated in backward (post-accumulate-
grad hooks), overlapping the backward of the layers before it. That is what the planner
models: each data layer's allreduce on the link once its backward is done. Collectives are
issued in order on one queue, so a conversion's backward collective runs after the
allreduces started before it. `finish_gradients()` waits for them, then divides every
gradient by W: each equals the one-process gradient of the global batch's mean loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm.communicator import Communicator
from plait.comm.core.request import Request
from plait.errors import ConfigError
from plait.parallel.convert import convert
from plait.parallel.kinds import kind_of, layers_of
from plait.parallel.layout import BATCH, FEATURES, Conversion, LayerPlan, rank_of, resolve
from plait.tensor_parallel.layers import sharded_parameters
from plait.tensor_parallel.parallelize import parallelize


class RowLinear(nn.Module):
    """A row layer's part: y_r = x_r A_r^T (+ b on rank 0 alone), summed over ranks by the
    conversion after it. Input (..., in / W), output (..., out) partial."""

    def __init__(self, linear: nn.Linear, comm: Communicator) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = nn.Parameter(w.chunk(comm.size, dim=1)[comm.rank].clone())
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(b.detach().clone())
        # the bias is added once to the sum: on rank 0; the others add 0 * b, so that its
        # gradient (zero there) is accumulated and its bucket starts on every rank alike
        self.bias_scale = 1.0 if comm.rank == 0 else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias * self.bias_scale
        return F.linear(x, self.weight, b)


def _column(linear: nn.Linear, comm: Communicator) -> nn.Linear:
    """A column layer's part: this rank's rows of the weight (output features) and bias."""
    w = linear.weight.detach()
    part = nn.Linear(linear.in_features, linear.out_features // comm.size,
                     bias=linear.bias is not None, device=w.device, dtype=w.dtype)  # fmt: skip
    with torch.no_grad():
        part.weight.copy_(w.chunk(comm.size, dim=0)[comm.rank])
        if linear.bias is not None:
            part.bias.copy_(linear.bias.chunk(comm.size)[comm.rank])
    return part


class Placeholder(nn.Module):
    """A layer another rank holds (`rank:R`): no parameters; it runs the layer on the meta
    device to know the shape, dtype and need of a gradient of R's output, and hands on a
    placeholder tensor of shape (0,) that needs a gradient where R's output does."""

    def __init__(self, layer: nn.Module, holder: int) -> None:
        super().__init__()
        self.holder = holder
        self.shadow = (layer.to("meta"),)  # a tuple: not a submodule, no parameters
        # what the layer gives for what it is given, worked out once: a meta forward runs
        # torch's meta kernels in Python (a gpt block's ~10 ms of CPU), and the ranks that
        # wait while R computes would take that CPU from R every step
        self._known: dict[tuple[object, ...], tuple[torch.Size, torch.dtype, bool]] = {}

    def forward(self, x: torch.Tensor, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(placeholder, the meta tensor R holds) -> the same after the layer."""
        grad = whole.is_floating_point() and x.requires_grad
        key = (whole.shape, whole.dtype, grad, torch.is_grad_enabled(), self.training)
        if key not in self._known:
            if whole.is_floating_point():
                whole = whole.detach().requires_grad_(x.requires_grad)
            out = self.shadow[0](whole)
            self._known[key] = (out.shape, out.dtype, out.requires_grad)
        shape, dtype, needs = self._known[key]
        y = x if x.dtype == dtype else x.to(dtype)
        if needs and not y.requires_grad:
            y = torch.empty(0, dtype=dtype, device=x.device, requires_grad=True)
        elif y.requires_grad and not needs:
            y = y.detach()
        return y, torch.empty(shape, dtype=dtype, device="meta")

    def extra_repr(self) -> str:
        return f"on rank {self.holder}: {type(self.shadow[0]).__name__}"


def _part(layer: nn.Module, choice: str, layout: str, comm: Communicator) -> nn.Module:
    """This rank's part of `layer` (module docstring)."""
    holder = rank_of(layout)
    if holder is not None and holder != comm.rank:
        return Placeholder(layer, holder)
    if choice == "column":
        assert isinstance(layer, nn.Linear)
        return _column(layer, comm)
    if choice == "row":
        assert isinstance(layer, nn.Linear)
        return RowLinear(layer, comm)
    if choice == "split":
        return parallelize(layer, comm)
    return layer  # data, follow, or rank:R on R


def _replicated(part: nn.Module, choice: str) -> list[nn.Parameter]:
    """`part`'s parameters that are the same on every rank (counted once by the norm)."""
    if choice == "data":
        return list(part.parameters())
    if choice == "row" and isinstance(part, RowLinear) and part.bias is not None:
        return [part.bias]
    if choice == "split":
        sharded = {id(p) for p in sharded_parameters(part)}
        return [p for p in part.parameters() if id(p) not in sharded]
    return []


def _broadcast(tensors: list[torch.Tensor], comm: Communicator) -> None:
    """Make `tensors` rank 0's: one broadcast per dtype (and device), flattened."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = comm.broadcast_(torch.cat([t.reshape(-1) for t in group]), 0)
            at = 0
            for t in group:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()


class _Bucket:
    """One layer's "sum" gradients: one allreduce, started once the last one is in."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.waiting = len(params)
        self.flat: torch.Tensor | None = None
        self.request: Request[torch.Tensor] | None = None
        self.checked = False

    def start(self, comm: Communicator) -> None:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        # the ranks' buckets are checked to agree once; then they cannot differ (DataParallel)
        self.request = comm.allreduce_async_(self.flat, check=not self.checked)
        self.checked = True

    def finish(self) -> None:
        assert self.request is not None and self.flat is not None
        self.request.wait()
        at = 0
        for p in self.params:
            got = self.flat[at : at + p.numel()].view_as(p)
            at += p.numel()
            if p.grad is None:
                p.grad = got.clone()
            else:
                p.grad.copy_(got)
        self.flat = self.request = None
        self.waiting = len(self.params)


class LayerParallel(nn.Module):
    """A model run by a per-layer plan: this rank's part of every layer (module docstring)."""

    def __init__(self, model: nn.Module, plan: LayerPlan, comm: Communicator) -> None:
        super().__init__()
        if plan.workers != comm.size:
            raise ConfigError(
                f"the plan is for {plan.workers} ranks and the communicator has {comm.size}: "
                f"make the plan for {comm.size} workers (or run it on {plan.workers})"
            )
        layers = layers_of(model)
        self.comm, self.plan = comm, plan
        self.resolved = resolve(plan, [kind_of(x) for x in layers])
        laid = zip(layers, plan.choices, self.resolved.layouts, strict=True)
        self.parts = nn.ModuleList(_part(x, choice, layout, comm) for x, choice, layout in laid)
        self._replicated: set[int] = set()
        self._buckets: list[_Bucket] = []
        for part, choice in zip(self.parts, plan.choices, strict=True):
            same = _replicated(part, choice)
            self._replicated |= {id(p) for p in same}
            self._sync(part, choice, same)
        self._started: list[_Bucket] = []

    def _sync(self, part: nn.Module, choice: str, same: list[nn.Parameter]) -> None:
        """Make `part`'s replicated tensors rank 0's; hook its "sum" gradients' bucket."""
        _broadcast([*same, *(part.buffers() if choice == "data" else ())], self.comm)
        summed = [p for p in same if p.requires_grad and choice in ("data", "row")]
        if summed:
            bucket = _Bucket(summed)
            self._buckets.append(bucket)
            for p in summed:
                p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad(b))

    def _on_grad(self, bucket: _Bucket) -> None:
        bucket.waiting -= 1
        if bucket.waiting == 0:
            bucket.start(self.comm)
            self._started.append(bucket)
        elif bucket.waiting < 0:
            raise RuntimeError(
                "a gradient accumulated twice before finish_gradients(): call "
                "finish_gradients() after every backward (no accumulation over backwards)"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the batch -> this rank's rows of the output."""
        whole: torch.Tensor | None = None  # the meta tensor rank R holds, on the others
        for i, part in enumerate(self.parts):
            x, whole = self._convert(self.resolved.before(i), x, whole)
            if isinstance(part, Placeholder):
                assert whole is not None
                x, whole = part(x, whole)
            else:
                x = part(x)
        x, _ = self._convert(self.resolved.before(len(self.parts)), x, whole)
        return x

    def _convert(
        self, conv: Conversion | None, x: torch.Tensor, whole: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if conv is None:
            return x, whole
        y = convert(x, conv, self.comm, whole)
        dst, src = rank_of(conv.dst), rank_of(conv.src)
        if dst is None or dst == self.comm.rank:
            return y, None
        if src is not None:  # rank src's tensor to rank dst
            return y, whole if src != self.comm.rank else x.detach().to("meta")
        shape = list(x.shape)  # this rank's part: the whole tensor's shape from it
        if conv.src == BATCH:
            shape[0] *= self.comm.size
        elif conv.src == FEATURES:
            shape[-1] *= self.comm.size
        return y, torch.empty(shape, dtype=x.dtype, device="meta")

    def finish_gradients(self) -> None:
        """After backward: sum the "sum" gradients over the ranks, then divide every
        gradient by W (module docstring). Call it once after every backward."""
        for bucket in self._buckets:  # a layer some of whose parameters got no gradient
            if bucket.waiting and bucket not in self._started:
                bucket.start(self.comm)
                self._started.append(bucket)
        for bucket in self._started:
            bucket.finish()
        self._started = []
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(self.comm.size)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the whole model's gradient norm is at most `max_norm`
        (after `finish_gradients`). The squares of sharded and rank-held gradients are
        summed over the ranks, replicated ones counted once (rank 0's): one allreduce.
        Returns the norm before clipping (float64 scalar), the same on every rank."""
        grads = [(p, p.grad) for p in self.parameters() if p.grad is not None]
        device = grads[0][1].device if grads else torch.device("cpu")
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for p, g in grads:
            if id(p) not in self._replicated or self.comm.rank == 0:
                total += g.double().pow(2).sum()
        norm = self.comm.allreduce(total)[0].sqrt()
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1.0:
            for _, g in grads:
                g.mul_(scale)
        return norm

    def extra_repr(self) -> str:
        return self.plan.label()


def apply(model: nn.Module, plan: LayerPlan, comm: Communicator) -> LayerParallel:
    """Run `model` by `plan` over `comm`'s ranks: this rank's part of each layer.

    Args:
        model: the full model, the same on every rank (the same seed): an nn.Sequential or
            a model with `layers()` (kinds.layers_of). It is taken over: its layers are
            reused (split ones parallelized in place, those another rank holds moved to
            the meta device).
        plan: one choice per layer, over `comm.size` workers.
        comm: every rank of the plan.

    Returns:
        The LayerParallel; its `parameters()` are this rank's only.

    Raises:
        ConfigError: the plan's workers are not the communicator's size, or a choice the
            layer does not take (layout.check).
        ValueError: (in forward) rows or features that do not split over the ranks.
    """
    return LayerParallel(model, plan, comm)

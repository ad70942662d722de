"""A per-layer plan and the layouts it implies: which conversion runs between which layers.

FlexFlow's SOAP space (Jia, Zaharia & Aiken, SysML 2019) lets each layer choose how it is
split over the workers. plait's per-layer plan gives each layer of the model (its pipeline
layers: an `nn.Sequential`'s children, or `model.layers()`) one *choice*, over all the
workers at once:

    data     Sample: the layer replicated, each rank its rows of the batch
    column   Parameter: an nn.Linear's output features split over the ranks
    row      Parameter: an nn.Linear's input features split, the outputs summed
    split    Megatron-LM's split of a transformer block (tensor_parallel.parallelize)
    rank:R   Operator: the layer on rank R alone, on the whole batch
    follow   a layer without parameters: it runs where its input is (see `resolve`)

A choice fixes the *layout* a layer takes and gives. A layout says where a tensor's values
are and, as autograd needs the conjugate, where its gradient is:

    batch    rank r holds rows r of dim 0 (the batch); each gradient row complete there
    features rank r holds slice r of the last dim; its gradient complete there
    full     every rank the whole tensor; every rank's gradient complete (Megatron's
             replicated activations: computing from it, a rank needs no other's gradient)
    full+    every rank the whole tensor; the gradient is the SUM of the ranks' (what a
             column-parallel layer leaves: each rank's gradient of its output slice only)
    partial  the value is the sum of the ranks' tensors; every rank's gradient complete
             (what a row-parallel layer gives before its sum)
    rank:R   rank R alone holds the whole tensor

Between two layers whose layouts differ, one conversion runs, whose forward and backward
are collectives conjugate to each other (`CONVERSIONS`); where they agree none runs. The
whole model takes `batch` (each rank its rows, as the data loader gives them) and the last
layer's output is converted to `batch`, so the loss is the data-parallel one.

Gradients: each rank backpropagates its own loss (its rows' mean), so every gradient is W
times the global batch's (W ranks; the conversions are exact adjoints). A parameter used
in `batch` or `full+` layout (data layers, a row layer's bias, added on rank 0 alone) has
its gradient spread over the ranks: `grad_sync` says "sum" and the runtime sums it; the
others ("none") are complete where they are (sharded ones, a split block's, rank:R's).
Then every gradient is divided by W.

No torch here: the planner (plait/plan/per_layer*) reads this too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plait.errors import ConfigError

BATCH, FEATURES, FULL, FULL_SUM, PARTIAL = "batch", "features", "full", "full+", "partial"

# what a layer is to the plan (kinds.py tells it from the module)
LINEAR = "linear"  # an nn.Linear: data, column, row, rank:R
BLOCK = "block"  # holds an attention or MLP tensor_parallel.parallelize splits: + split
PARAMS = "params"  # any other layer with parameters: data, rank:R
ELEMENTWISE = "elementwise"  # no parameters, elementwise (ReLU ...): runs in any layout
PER_SAMPLE = "per-sample"  # no parameters, each sample on its own (Flatten, MaxPool ...)

FOLLOW = "follow"
FIXED_CHOICES = ("data", "column", "row", "split")


def on(rank: int) -> str:
    """The layout, and the choice, of a tensor or layer on rank `rank` alone."""
    return f"rank:{rank}"


def rank_of(name: str) -> int | None:
    """R of "rank:R"; None for any other choice or layout."""
    return int(name.split(":", 1)[1]) if name.startswith("rank:") else None


@dataclass(frozen=True)
class LayerKind:
    """One layer, as the plan sees it (kinds.py builds these from the model)."""

    name: str  # for printing: "Linear(64, 2048)", "Block", "ReLU"
    kind: str  # LINEAR, BLOCK, PARAMS, ELEMENTWISE or PER_SAMPLE
    in_features: int = 0  # LINEAR: what row splits
    out_features: int = 0  # LINEAR: what column splits
    units: int = 0  # BLOCK: the gcd of its heads and MLP widths (split needs W | units)


def choices(layer: LayerKind, workers: int) -> tuple[str, ...]:
    """Every choice `layer` takes over `workers` ranks (a split must divide evenly)."""
    if layer.kind in (ELEMENTWISE, PER_SAMPLE):
        return (FOLLOW,)
    found = ["data"]
    if layer.kind == LINEAR and layer.out_features % workers == 0:
        found.append("column")
    if layer.kind == LINEAR and layer.in_features % workers == 0:
        found.append("row")
    if layer.kind == BLOCK and layer.units and layer.units % workers == 0:
        found.append("split")
    return (*found, *(on(r) for r in range(workers)))


def takes(choice: str) -> str:
    """The layout a layer of this (not follow) choice takes."""
    r = rank_of(choice)
    if r is not None:
        return on(r)
    return {"data": BATCH, "column": FULL_SUM, "row": FEATURES, "split": FULL}[choice]


def gives(choice: str) -> str:
    """The layout a layer of this (not follow) choice gives."""
    r = rank_of(choice)
    if r is not None:
        return on(r)
    return {"data": BATCH, "column": FEATURES, "row": PARTIAL, "split": FULL}[choice]


def runs_in(layer: LayerKind, layout: str) -> bool:
    """Whether a layer without parameters computes right in `layout` (a per-sample layer
    needs whole samples; nothing nonlinear runs on a partial sum)."""
    if layout == PARTIAL:
        return False
    return layer.kind == ELEMENTWISE or layout != FEATURES


@dataclass(frozen=True)
class Op:
    """One collective (or local step) of a conversion, on a tensor of `nbytes` for the whole
    global batch at that boundary (the planner costs it; the runtime runs it).

    kind: allgather, reduce_scatter, alltoall, allreduce, gather, scatter, broadcast,
    reduce, send (communication); slice, pad, keep (local, free). dim: "rows" (dim 0) or
    "cols" (the last dim) where it matters. root: gather/scatter/broadcast/reduce's rank,
    send's destination. src: send's source."""

    kind: str
    dim: str = ""
    root: int = -1
    src: int = -1

    @property
    def moves_bytes(self) -> bool:
        return self.kind not in ("slice", "pad", "keep")


# (from, to) -> (forward ops, backward ops), for layouts without a rank (see `conversion`)
CONVERSIONS: dict[tuple[str, str], tuple[tuple[Op, ...], tuple[Op, ...]]] = {
    (BATCH, FULL_SUM): ((Op("allgather", "rows"),), (Op("reduce_scatter", "rows"),)),
    (BATCH, FULL): ((Op("allgather", "rows"),), (Op("slice", "rows"),)),
    (BATCH, FEATURES): ((Op("alltoall", "rows"),), (Op("alltoall", "cols"),)),
    (FEATURES, BATCH): ((Op("alltoall", "cols"),), (Op("alltoall", "rows"),)),
    (FEATURES, FULL_SUM): ((Op("allgather", "cols"),), (Op("reduce_scatter", "cols"),)),
    (FEATURES, FULL): ((Op("allgather", "cols"),), (Op("slice", "cols"),)),
    (PARTIAL, BATCH): ((Op("reduce_scatter", "rows"),), (Op("allgather", "rows"),)),
    (PARTIAL, FEATURES): ((Op("reduce_scatter", "cols"),), (Op("allgather", "cols"),)),
    (PARTIAL, FULL): ((Op("allreduce"),), (Op("keep"),)),
    (PARTIAL, FULL_SUM): ((Op("allreduce"),), (Op("allreduce"),)),
    (FULL, BATCH): ((Op("slice", "rows"),), (Op("allgather", "rows"),)),
    (FULL, FEATURES): ((Op("slice", "cols"),), (Op("allgather", "cols"),)),
    (FULL, FULL_SUM): ((Op("keep"),), (Op("allreduce"),)),
    (FULL_SUM, BATCH): ((Op("slice", "rows"),), (Op("pad", "rows"),)),
    (FULL_SUM, FEATURES): ((Op("slice", "cols"),), (Op("pad", "cols"),)),
    # a complete gradient (full) as a sum over ranks (full+): rank 0 keeps it, others 0
    (FULL_SUM, FULL): ((Op("keep"),), (Op("pad", "", 0),)),
}


def conversion(src: str, dst: str) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """The forward and backward ops that turn layout `src` into `dst` (none when equal).

    Raises:
        ValueError: a conversion no plan needs (into `partial`).
    """
    if src == dst:
        return (), ()
    r, d = rank_of(src), rank_of(dst)
    if r is not None and d is not None:  # rank r's whole tensor to rank d
        return (Op("send", root=d, src=r),), (Op("send", root=r, src=d),)
    if d is not None:  # to rank d alone
        into = {
            BATCH: ((Op("gather", "rows", d),), (Op("scatter", "rows", d),)),
            FEATURES: ((Op("gather", "cols", d),), (Op("scatter", "cols", d),)),
            PARTIAL: ((Op("reduce", "", d),), (Op("broadcast", "", d),)),
            FULL: ((Op("keep", "", d),), (Op("broadcast", "", d),)),
            FULL_SUM: ((Op("keep", "", d),), (Op("pad", "", d),)),
        }
        return into[src]
    if r is not None:  # from rank r alone
        out = {
            BATCH: ((Op("scatter", "rows", r),), (Op("gather", "rows", r),)),
            FEATURES: ((Op("scatter", "cols", r),), (Op("gather", "cols", r),)),
            FULL: ((Op("broadcast", "", r),), (Op("keep", "", r),)),
            FULL_SUM: ((Op("broadcast", "", r),), (Op("reduce", "", r),)),
        }
        if dst not in out:
            raise ValueError(f"no conversion from {src} to {dst}: no layer takes {dst}")
        return out[dst]
    if (src, dst) not in CONVERSIONS:
        raise ValueError(f"no conversion from {src} to {dst}: no layer takes {dst}")
    return CONVERSIONS[(src, dst)]


@dataclass(frozen=True)
class Conversion:
    """A layout change before layer `before` (len(layers): after the last, into batch)."""

    before: int
    src: str
    dst: str
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]


@dataclass(frozen=True)
class Resolved:
    """Where each layer runs and what converts between them."""

    layouts: tuple[str, ...]  # per layer: the layout it computes in (takes)
    outputs: tuple[str, ...]  # per layer: the layout of its output (gives)
    conversions: tuple[Conversion, ...]  # in forward order

    def before(self, i: int) -> Conversion | None:
        return next((c for c in self.conversions if c.before == i), None)


def grad_sync(choice: str) -> str:
    """ "sum" where a layer's replicated parameters' gradients are spread over the ranks
    (data), "none" where they are complete where they are (column, split, rank:R); a row
    layer's weight is "none", its bias "sum" (the runtime asks per parameter)."""
    return "sum" if choice == "data" else "none"


@dataclass(frozen=True)
class LayerPlan:
    """One choice per layer of the model, over `workers` ranks: a plan as data."""

    choices: tuple[str, ...]
    workers: int
    names: tuple[str, ...] = ()  # each layer's LayerKind.name, for printing and checking

    def __post_init__(self) -> None:
        if self.names and len(self.names) != len(self.choices):
            raise ConfigError(f"{len(self.names)} layer names for {len(self.choices)} choices")
        if self.workers < 1:
            raise ConfigError(f"workers {self.workers} < 1")

    def label(self) -> str:
        """Short: the choices of the layers with parameters, in order."""
        picked = [c for c in self.choices if c != FOLLOW]
        return f"per-layer[{' '.join(picked)}] x{self.workers}"

    def to_json(self) -> dict[str, Any]:
        pairs = zip(self._names(), self.choices, strict=True)
        layers = [{"name": n, "choice": c} for n, c in pairs]
        return {"kind": "per-layer", "workers": self.workers, "layers": layers}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerPlan:
        """Raises: ConfigError: not a per-layer plan's JSON (what is missing)."""
        if data.get("kind") != "per-layer" or not isinstance(data.get("layers"), list):
            raise ConfigError(
                f"not a per-layer plan: expected {{'kind': 'per-layer', 'workers': N, "
                f"'layers': [{{'name': ..., 'choice': ...}}, ...]}}, got keys {sorted(data)}"
            )
        layers = data["layers"]
        return cls(
            choices=tuple(str(x["choice"]) for x in layers),
            workers=int(data["workers"]),
            names=tuple(str(x.get("name", "")) for x in layers),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def _names(self) -> tuple[str, ...]:
        return self.names or tuple(f"layer {i}" for i in range(len(self.choices)))


def check(plan: LayerPlan, layers: list[LayerKind]) -> None:
    """Raise unless `plan` fits these layers (one choice each, each one it takes).

    Raises:
        ConfigError: a count or a choice that does not fit, naming the layer and what it
            takes.
    """
    if len(plan.choices) != len(layers):
        raise ConfigError(
            f"the plan has {len(plan.choices)} layer choices and the model "
            f"{len(layers)} layers ({', '.join(x.name for x in layers)})"
        )
    for i, (layer, choice) in enumerate(zip(layers, plan.choices, strict=True)):
        allowed = choices(layer, plan.workers)
        if choice not in allowed:
            raise ConfigError(
                f"layer {i} ({layer.name}) cannot run {choice!r} over {plan.workers} ranks: "
                f"it takes {', '.join(allowed)}"
            )


def resolve(plan: LayerPlan, layers: list[LayerKind]) -> Resolved:
    """Each layer's layout and the conversions between them (module docstring).

    A `follow` layer keeps its input's layout where it runs in it (`runs_in`); else its
    input is converted to the layout the next layer with parameters takes, where it runs
    in that, else to batch.

    Raises:
        ConfigError: see `check`.
    """
    check(plan, layers)
    now, layouts, outputs, convs = BATCH, [], [], []

    def to(i: int, dst: str) -> None:
        nonlocal now
        if dst != now:
            fwd, bwd = conversion(now, dst)
            convs.append(Conversion(i, now, dst, fwd, bwd))
            now = dst

    for i, (layer, choice) in enumerate(zip(layers, plan.choices, strict=True)):
        if choice == FOLLOW:
            if not runs_in(layer, now):
                after = next((c for c in plan.choices[i + 1 :] if c != FOLLOW), "data")
                want = takes(after)
                to(i, want if runs_in(layer, want) else BATCH)
            layouts.append(now)
        else:
            to(i, takes(choice))
            layouts.append(now)
            now = gives(choice)
        outputs.append(now)
    to(len(layers), BATCH)
    return Resolved(tuple(layouts), tuple(outputs), tuple(convs))


def data_parallel(layers: list[LayerKind], workers: int) -> LayerPlan:
    """Every layer data-parallel: plain data parallelism, as a per-layer plan."""
    picked = tuple("data" if x.kind not in (ELEMENTWISE, PER_SAMPLE) else FOLLOW for x in layers)
    return LayerPlan(picked, workers, tuple(x.name for x in layers))

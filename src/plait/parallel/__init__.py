"""Per-layer parallelism, as FlexFlow searches it: each layer data-parallel or split its own way.

`layout.py` is the plan as data and the conversions it implies (no torch); `kinds.py` tells
what each layer of a model is to a plan; `convert.py` runs one conversion over plait's
collectives and `apply.py` a whole plan (`apply(model, plan, comm) -> LayerParallel`),
imported on first use (they need the communicator; the planner reads layout.py alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from
from plait.parallel.kinds import kinds, layers_of
from plait.parallel.layout import LayerKind, LayerPlan, Resolved, resolve

if TYPE_CHECKING:
    from plait.parallel.apply import LayerParallel, apply

__all__ = ["LayerKind", "LayerParallel", "LayerPlan", "Resolved", "apply", "kinds", "layers_of",
           "resolve"]  # fmt: skip

__getattr__ = getattr_from(
    __name__, {"LayerParallel": "plait.parallel.apply", "apply": "plait.parallel.apply"}
)

"""Per-layer parallelism, as FlexFlow searches it: each layer data-parallel or split its own way.

`layout.py` is the plan as data and the conversions it implies (no torch); `kinds.py` tells
what each layer of a model is to a plan.
"""

from plait.parallel.kinds import kinds, layers_of
from plait.parallel.layout import LayerKind, LayerPlan, Resolved, resolve

__all__ = ["LayerKind", "LayerPlan", "Resolved", "kinds", "layers_of", "resolve"]

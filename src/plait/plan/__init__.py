"""The planner (`plait plan`): predict how every way of running a training step performs on
a machine (or a cluster this machine is not), and rank them.

    from plait.plan import Plan, Prediction, PlanRequest, search
    preds = search(PlanRequest(model="gpt", workers=4))   # best first, feasible first
    preds[0].plan.train_args()                            # the plait train flags that run it

profile.py measures each layer once per model and machine; costs.py prices communication
with the calibrated alpha-beta model; graph.py runs a task graph on queues (FlexFlow's
simulator); simulate.py builds a plan's step as one; search.py enumerates or walks the
candidates; calibrate.py fits what a real step pays beyond the profile (overheads.py) from
a few real runs (runs.py), once per machine. See docs/planning.md.

The search needs torch (it profiles), so it is imported on first use: the command line
parses `plait plan`'s options without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from
from plait.plan.plan import Plan, PlanRequest, Prediction, parse_rate

if TYPE_CHECKING:
    from plait.plan.search import RUNNABLE_SCHEDULES, search

_LAZY = {"RUNNABLE_SCHEDULES": "plait.plan.search", "search": "plait.plan.search"}

__all__ = ["RUNNABLE_SCHEDULES", "Plan", "PlanRequest", "Prediction", "parse_rate", "search"]

__getattr__ = getattr_from(__name__, _LAZY)

"""What every candidate of a search shares: the simulator's, the memory model's and the
fits' common input (simulate.py, reductions.py, memory.py, fit.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.plan.costs import Costs
from plait.plan.overheads import Overheads
from plait.plan.profile import Profile


@dataclass(frozen=True)
class Setting:
    """What every candidate of a search shares."""

    profile: Profile
    batch: int  # global batch
    costs: Costs
    cores: int  # per host (the profiled machine's)
    memory_limit: int | None = None
    overheads: Overheads = field(default_factory=Overheads)  # fitted costs beyond the profile
    clipping: bool = False  # the recipe clips the gradients' norm: a barrier across stages

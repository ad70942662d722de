"""`plait train --plan best`: fill in the options of the planner's best plan for the run.

The run's own options fix the request (model or workload, workers, batch); the planner
chooses the rest. An option the plan would choose, given by the user too, is an error:
one of the two would be ignored.
"""

from __future__ import annotations

import sys
from typing import Any

from plait.errors import ConfigError
from plait.options import flag

PLANS = ("best",)
# the options a plan sets (Plan.options()), and reduce_dtype, compression's other name
CHOSEN = (
    "strategy", "dp", "pp", "tp", "zero", "chunks", "schedule", "virtual",
    "activation_checkpointing", "precision", "compression", "reduce_dtype", "priority",
)  # fmt: skip


def choose(
    plan: str, options: dict[str, Any], memory_per_rank: int | None = None
) -> dict[str, Any]:
    """`options` with the best feasible plan's filled in; prints `plan: <label> (predicted
    ... ms/step)` to stderr.

    Raises:
        ConfigError: a plan other than "best", an option the plan chooses given too, or no
            plan that runs with the other options.
    """
    from plait.plan.plan import PlanRequest
    from plait.plan.search import search
    from plait.train.config import TrainConfig

    if plan not in PLANS:
        raise ConfigError(f"--plan {plan!r}: only --plan best is built (the top-ranked plan)")
    given = [n for n in CHOSEN if n in options]
    if given:
        shown = ", ".join(f"{flag(n)} {options[n]}".replace(" True", "") for n in given)
        verb = "chooses" if len(given) == 1 else "choose"
        raise ConfigError(f"--plan best {verb} {', '.join(flag(n) for n in given)}; drop {shown}")
    req = PlanRequest(
        model=options.get("model", None if "workload" in options else "mlp"),
        workers=options.get("workers", TrainConfig.workers),
        memory_per_rank=memory_per_rank,
        batch_size=options.get("batch_size"),
        workload=options.get("workload"),
        # a run asked onto the GPUs is planned for them (auto is planned for the CPU)
        device="cuda" if options.get("device") == "cuda" else "cpu",
    )
    for pred in search(req):
        if not pred.feasible:
            break
        chosen = {**options, **pred.plan.options()}
        try:
            TrainConfig.from_options(chosen)
        except (ConfigError, TypeError):
            continue  # the user's other options refuse this plan: the next one
        print(f"plan: {pred.plan.label()} (predicted {pred.step_s * 1e3:.1f} ms/step)",
              file=sys.stderr)  # fmt: skip
        return chosen
    raise ConfigError("--plan best: no plan the planner predicts fits these options")

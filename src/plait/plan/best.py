"""`plait train --plan best`: fill in the options of the planner's best plan for the run.

The run's own options fix the request (model or workload, workers, batch); the planner
chooses the rest: the per-layer search (plait.plan.per_layer_search) answers with the plan
it predicts fastest, a per-layer plan (each layer split its own way: passed on to the run
as `--plan` with the plan's JSON) or the best global plan (its options, as if typed). An
option the plan would choose, given by the user too, is an error: one of the two would be
ignored. `--plan FILE` is left to the run (plait/train/layer_plan.py).
"""

from __future__ import annotations

import sys
from typing import Any

from plait.errors import ConfigError
from plait.options import flag

BEST = "best"
# the options a plan sets (Plan.options()), and reduce_dtype, compression's other name
CHOSEN = (
    "strategy", "dp", "pp", "tp", "zero", "chunks", "schedule", "virtual",
    "activation_checkpointing", "precision", "compression", "reduce_dtype", "priority",
)  # fmt: skip


def choose(options: dict[str, Any], memory_per_rank: int | None = None) -> dict[str, Any]:
    """`options` with the best feasible plan's filled in when they say `--plan best` (else
    `options` as they are); prints `plan: <what it chose> (predicted ... ms/step)` to
    stderr.

    Raises:
        ConfigError: an option the plan chooses given too, or no plan that runs with the
            other options.
    """
    if options.get("plan") != BEST:
        return options
    given = [n for n in CHOSEN if n in options]
    if given:
        shown = ", ".join(f"{flag(n)} {options[n]}".replace(" True", "") for n in given)
        verb = "chooses" if len(given) == 1 else "choose"
        raise ConfigError(f"--plan best {verb} {', '.join(flag(n) for n in given)}; drop {shown}")
    from plait.parallel.layout import LayerPlan
    from plait.plan.per_layer_search import search_layers
    from plait.plan.plan import PlanRequest
    from plait.train.config import TrainConfig

    req = PlanRequest(
        model=options.get("model", None if "workload" in options else "mlp"),
        workers=options.get("workers", TrainConfig.workers),
        memory_per_rank=memory_per_rank,
        batch_size=options.get("batch_size"),
        workload=options.get("workload"),
        # a run asked onto the GPUs is planned for them (auto is planned for the CPU)
        device="cuda" if options.get("device") == "cuda" else "cpu",
    )
    answer = search_layers(req)
    rest = {k: v for k, v in options.items() if k != "plan"}
    best_global = answer.best_global
    if isinstance(answer.chosen, LayerPlan):
        chosen = {**rest, "plan": answer.chosen.dumps()}
        if _runs(chosen):
            beside = ""
            if best_global is not None:
                beside = (f"; the best global plan, {best_global.plan.label()}: "
                          f"{best_global.step_s * 1e3:.1f} ms/step")  # fmt: skip
            print(f"plan: {answer.chosen.label()} (predicted "
                  f"{answer.best_layers.step_s * 1e3:.1f} ms/step{beside})",
                  file=sys.stderr)  # fmt: skip
            return chosen
    return _best_global(req, rest, best_global)


def _best_global(req: Any, options: dict[str, Any], first: Any) -> dict[str, Any]:
    """`options` with the fastest feasible global plan's that runs with them: the per-layer
    search's best global plan `first`, else the next of the global search's."""
    from plait.plan.search import search

    def ranked() -> Any:
        if first is not None:
            yield first
        yield from search(req)

    for pred in ranked():
        if not pred.feasible:
            break
        chosen = {**options, **pred.plan.options()}
        if not _runs(chosen):
            continue  # the user's other options refuse this plan: the next one
        typed = " ".join(pred.plan.train_args())
        print(f"plan: {pred.plan.label()} ({typed}; predicted {pred.step_s * 1e3:.1f} ms/step)",
              file=sys.stderr)  # fmt: skip
        return chosen
    raise ConfigError("--plan best: no plan the planner predicts fits these options")


def _runs(options: dict[str, Any]) -> bool:
    """Whether a run takes `options` (TrainConfig's checks; not yet the machine's)."""
    from plait.train.config import TrainConfig

    try:
        TrainConfig.from_options(options)
    except (ConfigError, TypeError):
        return False
    return True

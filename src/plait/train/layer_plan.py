"""`plait train --plan FILE`: the per-layer plan a run trains with, read and checked against
the other options (before any worker starts; the model's fit is preflight.py's).

A per-layer plan (plait.parallel.layout.LayerPlan) says how each layer splits over all the
workers, so the options that split the model or the gradient's reduction another way
(--pp, --tp, --zero, --strategy ps, --compression, --priority) do not run with it; nor,
yet, those its runtime (plait.parallel.apply) does not take: --precision other than fp32,
--activation-checkpointing, --compile, lars and lamb (their norms are of whole layers,
which a split layer's ranks hold in slices), checkpoints, --elastic, --teacher.

`--plan best` is the planner's (plait/plan/best.py, in the `plait train` command): it
passes a chosen per-layer plan on as the plan's JSON text, which `read` takes too. No torch
here (the command line reads this).
"""

from __future__ import annotations

import json
from typing import Any

from plait.options import flag
from plait.train.errors import ConfigError
from plait.train.strategies import STRATEGIES

BEST = "best"

# option -> (the value that is not refused, why the others are): the options a per-layer
# plan does not run with, as config.options() names them
SPLITS = "the plan already says how each layer splits over the workers"
REFUSED: dict[str, tuple[Any, str]] = {
    "pp": (1, SPLITS),
    "tp": (1, SPLITS),
    "zero": (0, SPLITS),
    "priority": (False, "its slices reduce a whole replicated model's gradients"),
    "compression": ("none", "the plan's conversions and gradient sums send float32"),
    "reduce_dtype": ("fp32", "the plan's conversions and gradient sums send float32"),
    "precision": ("fp32", "its conversions are not run under autocast yet"),
    "activation_checkpointing": (False, "its layers are not checkpointed yet"),
    "compile": (False, "torch.compile cannot trace its conversions' collectives"),
    "out": (None, "checkpoints of a per-layer run (its slices and rank:R layers gathered "
                  "into the whole model's names) are not built yet"),
    "resume": (False, "checkpoints of a per-layer run are not built yet"),
    "elastic": (False, "a dead rank's slices live on no other rank"),
    "teacher": (None, "distillation is not run through a per-layer model yet"),
    "trace_blocks": (False, "its blocks are the plan's layers, not hooked yet"),
}  # fmt: skip
OPTIMIZERS = ("sgd", "adamw")  # elementwise: a slice steps as its whole layer would


def check_options(plan: str, options: dict[str, Any]) -> None:
    """Refuse the options a run with `--plan plan` does not take (module docstring).

    Args:
        options: the run's options by name, filled in (TrainConfig.options()).

    Raises:
        ConfigError: naming --plan and the first option it does not run with.
    """
    named = shown(plan)
    if plan == BEST:
        raise ConfigError(
            "--plan best runs the planner, which the `plait train` command does before the "
            "config is made: from Python, give the chosen plan's file (plait plan --per-layer "
            "--json FILE) or its JSON"
        )
    strategy = options["strategy"]
    if STRATEGIES[strategy].layer_step is None:
        with_plan = " or ".join(n for n, row in STRATEGIES.items() if row.layer_step)
        raise ConfigError(
            f"--plan {named} runs a per-layer plan over the ranks of --strategy {with_plan}, "
            f"not --strategy {strategy}: {SPLITS}"
        )
    for name, (allowed, why) in REFUSED.items():
        value = options.get(name, allowed)
        if value != allowed:
            given = flag(name) if isinstance(value, bool) else f"{flag(name)} {value}"
            raise ConfigError(f"--plan {named} does not run with {given}: {why}")
    if options["optimizer"] not in OPTIMIZERS:
        raise ConfigError(
            f"--plan {named} does not run with --optimizer {options['optimizer']} yet: its "
            "per-layer norms would be of the slices a split layer's ranks hold; use "
            f"--optimizer {' or '.join(OPTIMIZERS)}"
        )


def read(plan: str) -> dict[str, Any]:
    """The per-layer plan `--plan plan` names, as LayerPlan.to_json gives it: read from the
    file `plan` (the plan's JSON, or a file with it under "per_layer", as `plait plan
    --per-layer --json FILE` writes), or parsed from `plan` itself when it is JSON text.

    Raises:
        ConfigError: the file missing, not JSON, or not a per-layer plan.
    """
    from plait.parallel.layout import LayerPlan

    named = shown(plan)
    text = plan if plan.lstrip().startswith("{") else _text_of(plan)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--plan {named}: not JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("per_layer"), dict):
        data = data["per_layer"]  # plait plan --per-layer --json's (the plan, its figures)
    if not isinstance(data, dict):
        raise ConfigError(f"--plan {named}: not a per-layer plan: a JSON {type(data).__name__}")
    try:
        return LayerPlan.from_json(data).to_json()
    except ConfigError as e:
        raise ConfigError(f"--plan {named}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--plan {named}: not a per-layer plan ({e!r})") from None


def check_workers(plan: str, data: dict[str, Any], workers: int) -> None:
    """The plan is for `workers` ranks.

    Raises:
        ConfigError: saying both numbers.
    """
    if int(data["workers"]) != workers:
        raise ConfigError(
            f"--plan {shown(plan)} is a plan for {data['workers']} workers, not --workers "
            f"{workers}: make it for {workers} (plait plan --per-layer --workers {workers}), "
            f"or give --workers {data['workers']}"
        )


def label(data: dict[str, Any]) -> str:
    """The plan's short label ("per-layer[column row] x2")."""
    from plait.parallel.layout import LayerPlan

    return LayerPlan.from_json(data).label()


def _text_of(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"--plan {path}: no such file (a per-layer plan's JSON, as plait plan --per-layer "
            "--json FILE writes it, or best)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--plan {path}: cannot read it ({e})") from None


def shown(plan: str) -> str:
    """--plan's value as an error shows it: a plan's JSON text (from --plan best) as
    "<plan JSON>"."""
    return "<plan JSON>" if plan.lstrip().startswith("{") else plan

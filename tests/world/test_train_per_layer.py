"""`plait train --plan`: a per-layer plan trains as plain data parallelism does, in one world
of 2 ranks (the options' checks are in tests/unit/test_train_plan_options.py; the runtime's
exactness, float64 at 2-4 ranks, is the runtime's own test).

mlp split as Megatron-LM splits an MLP (the first Linear by its outputs, the second by its
inputs) and mlp plain data-parallel, same seed, same batches: the losses agree within
float32 rounding. The per-layer run also records a trace (--trace), and its plan is the one
`--plan best` passes on to a run (the plan's JSON text, plan/best.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait import Communicator
from plait.parallel.layout import LayerPlan
from plait.train.config import TrainConfig
from plait.train.loop import train
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
OPTIONS = {"model": "mlp", "steps": 3, "batch_size": 16, "seed": 3}
MEGATRON = LayerPlan(("follow", "column", "follow", "row"), 2)
ON_ONE = LayerPlan(("follow", "rank:0", "follow", "rank:0"), 2)  # rank 1 holds nothing
# float32: each rank's matmuls sum over half the features and the conversions add the
# halves, another order than one whole matmul's: a relative error ~1e-7 per sum (eps
# 1.2e-7), ~1e-6 after 3 steps. 1e-5 allows that; any scale or sign error in a gradient
# (a missing 1/W, a sum where a slice belongs) moves the second loss by 1e-3 or more.
RTOL = 1e-5


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    def run(**more: Any) -> dict[str, Any]:
        config = TrainConfig.from_options({**OPTIONS, "workers": comm.size, **more})
        figures: dict[str, Any] = train(config, comm).figures()
        return figures

    plan = json.dumps(MEGATRON.to_json())  # as --plan best passes it on
    return {"plain": run(), "split": run(plan=plan, trace=f"{tmp}/trace.json"),
            "one": run(plan=json.dumps(ON_ONE.to_json()))}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_per_layer_plan_trains_as_data_parallelism(tmp_path: Path) -> None:
    results = run_world(2, battery, str(tmp_path), env=ENV)
    plain, split = results[0]["plain"], results[0]["split"]
    assert split["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    assert len(split["losses"]) == 3 and plain["losses"][0] != plain["losses"][-1]
    assert split["eval_value"] == pytest.approx(plain["eval_value"], abs=0.01)  # accuracy
    assert split["plan"] == MEGATRON.to_json()
    memory = split["rank_memory"]  # each rank half of each Linear's weight (row: bias on one)
    assert len(memory) == 2 and memory[0]["parameters"] < plain["rank_memory"][0]["parameters"]
    assert (tmp_path / "trace.json").is_file()
    assert results[1]["split"]["losses"] == split["losses"]  # every rank reports the same
    # the whole model on rank 0: rank 1 steps an optimizer over no parameter of its own
    one = results[0]["one"]
    assert one["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    assert one["rank_memory"][1]["parameters"] == 0 < one["rank_memory"][0]["parameters"]

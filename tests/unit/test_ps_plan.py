"""The planner's parameter-server step, as train/steps/ps.py runs it, and a ps worker's
memory as `plait train --json` reports it (no process is started)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from plait.plan import Plan
from plait.plan.costs import Costs
from plait.plan.reductions import server_share
from plait.plan.setting import Setting
from plait.plan.simulate import graph, simulate
from plait.train.steps.ps import KEY, ParameterServerStep
from support.plan_profiles import fake

pytestmark = pytest.mark.usefixtures("no_calibration")

PROF = fake(layers=4, f=1.0, b=2.0, params=1 << 18)  # 1 MiB of fp32 a layer
COSTS = Costs.of(local=4, link_bytes_per_s=None)


def spans(plan: Plan) -> tuple[float, dict[str, list[tuple[str, float, float]]]]:
    """The predicted step and, per category, its tasks' (name, start, end)."""
    s = Setting(PROF, 64, COSTS, 1000, clipping=True)
    g, run = graph(plan, s)
    found: dict[str, list[tuple[str, float, float]]] = {}
    for i, t in enumerate(g.tasks):
        found.setdefault(t.cat, []).append((t.name, *run.spans[i]))
    return simulate(plan, s).step_s, found


def test_a_worker_pushes_after_its_whole_backward_and_waits_for_its_pull():
    step, cat = spans(Plan(strategy="ps", dp=2))
    backward = max(end for _, _, end in cat["backward"])
    ((_, push, pushed),) = cat["push"]
    assert backward == pytest.approx(4 * 3.0) and push == backward  # nothing overlaps it
    ((_, update, updated),), ((_, pull, pulled),) = cat["update"], cat["pull"]
    assert update == pushed and pull == updated and step == pulled  # one of each, in turn
    # the model (4 MiB: DataParallel would reduce 2 buckets) is one key, on one server
    assert pushed - push == pytest.approx(COSTS.to_servers(4.0 * (4 << 18), 2, 1))


def test_with_priority_the_pull_comes_back_in_the_forwards_order():
    step, cat = spans(Plan(strategy="ps", dp=2, priority=True))
    pulls = sorted(cat["pull"], key=lambda e: e[1])
    assert [name for name, _, _ in pulls] == ["pull L0", "pull L1", "pull L2", "pull L3"]
    assert step < spans(Plan(strategy="ps", dp=2))[0]  # the next forward starts on L0


def test_the_busiest_server_holds_what_the_sharding_gives_it():
    assert server_share((1 << 16,) * 4, 2) == 4 << 16  # packed into one key of 1 MiB
    assert server_share((1 << 20,) * 4, 2) == 2 << 20  # a key of 4 MiB each, two a server
    assert server_share((3 << 20,), 2) == 2 << 20  # cut into 3 slices of 4 MiB


class Store:
    """The run's store, as a ParameterServerStep uses it."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


def test_a_worker_reports_its_parameters_and_gradients_and_no_optimizer_state():
    model = nn.Linear(3, 2)  # 8 parameters
    model(torch.ones(1, 3)).sum().backward()
    compute = SimpleNamespace(activation_bytes=12)
    store = Store()
    for rank in (0, 2):  # worker 1 died: it never finished
        me = SimpleNamespace(model=model, compute=compute, store=store, rank=rank,
                             elastic=True)  # fmt: skip
        me.held = lambda me=me: ParameterServerStep.held(me)
        ParameterServerStep.finish(me)  # type: ignore[arg-type]
    row = {"parameters": 32, "gradients": 32, "optimizer": 0, "model_states": 64,
           "activations": 12, "buffers": 0}  # fmt: skip
    assert json.loads(store.get(KEY + "memory/2")) == row
    reporter = SimpleNamespace(store=store, world_size=3)
    found = ParameterServerStep.rank_memory(reporter)  # type: ignore[arg-type]
    assert found == {"rank_memory": [row, row]}

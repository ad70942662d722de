"""The planner's per-precision lines (each layer timed under each autocast, plan/profile.py)
and `plait plan --device cuda` (a GPU profile, NCCL's link costs; an error without a GPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.bench.plan.config import PlanBenchConfig
from plait.cli.main import main
from plait.comm.dispatch import auto
from plait.errors import ConfigError
from plait.plan import Plan, PlanRequest
from plait.plan import profile as profiling
from plait.plan.costs import NCCL, Costs
from plait.plan.profile import LayerCost, Profile, at, layer_cost
from plait.plan.runs import train_argv
from plait.plan.setting import Setting
from plait.plan.simulate import graph as simulate_graph
from plait.plan.simulate import simulate
from plait.train.data.base import TensorData
from plait.train.workload import ACCURACY, Workload
from support.plan_profiles import fake

pytestmark = pytest.mark.usefixtures("no_calibration")


def _with_bf16(layers: int = 4) -> Profile:
    """fake(): fp32 f=1 b=2; bf16 3x by the whole-model factor, but layer 0 has its own
    measured bf16 lines (forward 0.5 s, backward 1 s, 100 bytes kept per sample)."""
    prof = fake(layers=layers, saved=10.0)
    prof.precisions["bf16"] = (3.0, 0.5)
    prof.layers[0].by_precision["bf16"] = ((0.5, 0.0), (1.0, 0.0), (0.0, 100.0))
    return prof


def test_layer_cost_reads_a_layers_own_lines_else_the_whole_models_factors():
    prof = _with_bf16()
    first, other = prof.layers[0], prof.layers[1]
    assert layer_cost(prof, first, "bf16", 4) == (0.5, 1.0, 400.0)
    assert layer_cost(prof, other, "bf16", 4) == (3.0, 6.0, 5.0)  # a fake without lines
    # fp32 is the layer's own fields, exactly: fp32 predictions did not move
    line = LayerCost("x", (0.1, 0.3), (0.2, 0.7), (5.0, 3.0), 0, 1.0, 1.0)
    assert layer_cost(prof, line, "fp32", 3) == (at(line.forward, 3), at(line.backward, 3), 14.0)


def test_the_simulator_times_and_counts_each_layer_in_the_plans_precision():
    prof = _with_bf16()
    s = Setting(prof, 64, Costs(local=1), cores=1000)
    assert simulate(Plan(dp=1), s).step_s == 4 * 3.0
    # layer 0 at its own 0.5 + 1 s, the other three at 3x fp32's 1 + 2 s
    pred = simulate(Plan(dp=1, precision="bf16"), s)
    assert pred.step_s == pytest.approx(1.5 + 3 * 9.0)
    # activations kept: layer 0's 100 bytes a sample (64 of them), the others' 10 * 0.5
    fp32 = simulate(Plan(dp=1), s).peak_bytes[0]
    assert pred.peak_bytes[0] - fp32 == pytest.approx(6400 + 3 * 5 - 4 * 10, abs=1)


def test_profile_json_keeps_the_per_precision_lines_and_the_device():
    prof = replace(_with_bf16(), device="cuda")
    back = Profile.from_json(prof.to_json())
    assert back == prof and back.layers[0].by_precision["bf16"][2] == (0.0, 100.0)


def test_zero_bubble_splits_the_backward_as_profiled():
    prof = fake(layers=2, f=1.0, b=2.0)
    for layer in prof.layers:  # B 1.5 s, W 1.0 s: more than the backward's 2 together
        layer.halves = ((1.5, 0.0), (1.0, 0.0))
    s = Setting(prof, 8, Costs.of(8, None), cores=8)
    g, run = simulate_graph(Plan(pp=2, chunks=1, schedule="zb-h1"), s)
    took = {t.name: end - start for t, (start, end) in zip(g.tasks, run.spans, strict=True)}
    assert took["B0"] == 1.5 and took["W0 L1"] == 1.0  # stage 1's layer 1: its own halves
    unsplit = replace(prof, layers=[replace(x, halves=None) for x in prof.layers])
    g, run = simulate_graph(Plan(pp=2, chunks=1, schedule="zb-h1"), replace(s, profile=unsplit))
    took = {t.name: end - start for t, (start, end) in zip(g.tasks, run.spans, strict=True)}
    assert took["B0"] == 1.0 and took["W0 L1"] == 1.0  # without them: half the backward each


def _tiny() -> Workload:
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    data = TensorData("tiny", x[:30], y[:30], x[30:], y[30:])

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    return Workload(name="tiny", model=model, data=data, loss=F.cross_entropy, metric=ACCURACY)


def _measured(device: str) -> Profile:
    prof = profiling.measure(_tiny(), 2, 4, "sgd", device)
    assert prof.device == device and "fp32" in prof.precisions
    low = [name for name in prof.precisions if name != "fp32"]
    for layer in prof.layers:  # its own lines for every precision that runs, fp32 its fields
        assert sorted(layer.by_precision) == sorted(low)
        for lines in layer.by_precision.values():
            assert all(a >= 0 and c >= 0 for a, c in lines)
        assert layer.halves is not None  # zero-bubble's B and W, each timed on its own
        assert all(a >= 0 and c >= 0 for a, c in layer.halves)
    assert Profile.from_json(prof.to_json()) == prof  # the halves' lines kept as tuples
    return prof


def test_measure_times_every_layer_under_each_precision(monkeypatch):
    monkeypatch.setattr(profiling, "REPEATS", 1)
    prof = _measured("cpu")
    assert "bf16" in prof.precisions  # torch 2.13 autocasts to bf16 on the CPU
    # the first Linear(4, 8) keeps its input: 4 fp32 elements a sample; under autocast a
    # bf16 copy of it (half the bytes) and the bf16 copy of its 32 weights, once per call:
    # no single factor on fp32's bytes says that
    first = prof.layers[0]
    assert first.saved == (0.0, 16.0) and first.by_precision["bf16"][2] == (64.0, 8.0)


def test_plan_device_cuda_without_a_gpu_fails_at_once(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def measured(*args: object) -> Profile:
        raise AssertionError("nothing is measured for a device that is not here")

    monkeypatch.setattr(profiling, "cached", measured)
    assert main(["plan", "--model", "gpt", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda asks to profile gpt on a CUDA GPU" in err
    assert "this machine has none" in err and "CPU cores" in err and "--device cpu" in err
    with pytest.raises(ConfigError, match="device 'tpu' is not one of cpu, cuda"):
        PlanRequest(device="tpu")


def test_gpus_cost_their_links_as_nccl_and_the_bench_passes_the_device_on():
    n, ranks = 1 << 20, [0, 1, 2, 3]
    gpu, cpu = Costs.of(4, None, "cuda"), Costs.of(4, None)
    nccl = min(auto.predict(a, n, 4, NCCL) for a in auto.FLAT["allreduce"])
    assert gpu.allreduce(n, ranks) == nccl < cpu.allreduce(n, ranks)
    assert gpu.send(n, 0, 1) == NCCL.alpha + n * NCCL.beta < cpu.send(n, 0, 1)
    assert PlanRequest(model="gpt", device="cuda").train_options()["device"] == "cuda"
    assert "device" not in PlanRequest(model="gpt").train_options()
    cuda = PlanBenchConfig(model="gpt", device="cuda").fixed()
    argv = train_argv(["--workers", "2"], cuda, 3, 0, "o.json")
    assert argv[argv.index("--device") + 1] == "cuda"
    assert "--device" not in train_argv([], PlanBenchConfig(model="gpt").fixed(), 3, 0, "o.json")


@pytest.mark.cuda
def test_plan_profiles_and_plans_on_the_gpu(monkeypatch):
    # imported here: at collection it would shadow `plait.plan.search`, the function that
    # test_plan.py imports, with the module of that name
    from plait.plan.search import setting

    monkeypatch.setattr(profiling, "REPEATS", 1)
    prof = _measured("cuda")
    assert {"bf16", "fp16"} <= set(prof.precisions)  # autocast "cuda" takes both
    s, _ = setting(PlanRequest(model="mlp", workers=1, device="cuda"), prof)
    assert s.costs.device == "cuda" and s.cores == torch.cuda.device_count()
    assert simulate(Plan(dp=1, precision="bf16"), s).step_s > 0

"""`plait bench torch-backend` without a run: the rows, their ratios and bars, a way that
failed named with its error instead of a figure, and bad values (the run itself is in
tests/e2e/test_bench.py)."""

from __future__ import annotations

import pytest
from torch import nn

from plait.bench import render, wrapping
from plait.bench.torch_backend import tables
from plait.bench.torch_backend.config import TorchBackendBenchConfig, bar_for
from plait.errors import ConfigError


def _ways(plait: list[float] | str, gloo: list[float] | str) -> dict:
    def one(v: list[float] | str) -> dict:
        return {"failed": v} if isinstance(v, str) else {"round_s": v}

    return {"ways": {"plait": one(plait), "gloo": one(gloo)}}


RUN = {
    "world_size": 4,
    "peer": "gloo",
    "latency": _ways([1e-4, 2e-4, 1e-4], [4e-4, 3e-4, 5e-4]),
    "workloads": {
        "wide": {
            "parameters": 10,
            "ddp": {**_ways([2.0, 1.0, 4.0], [3.0, 1.0, 4.0]), "max_param_diff": 1e-7},
            "fsdp2": _ways("rank 1: RuntimeError: no reduce_scatter", [3.0, 3.0, 3.0]),
        },
        "gpt": {"parameters": 20, "ddp": {**_ways([1.0] * 3, [1.0] * 3), "max_param_diff": 0.0}},
    },
}


def test_rows_pair_the_rounds_and_hold_each_to_its_bar() -> None:
    rows = tables.summarize([RUN])
    assert [(r["workload"], r["measure"]) for r in rows] == [
        ("all_reduce 16 B", "latency"), ("wide", "ddp"), ("wide", "fsdp2"), ("gpt", "ddp")
    ]  # fmt: skip
    latency, wide, fsdp2, gpt = rows
    # per round gloo / plait: 4, 1.5, 5 -> median 4; the ratio of the medians would be 4 too
    assert latency["ratio"] == 4.0 and latency["met"] is True
    # per round 1.5, 1, 1 -> median 1 (the ratio of the medians: 3 / 2 = 1.5)
    assert wide["ratio"] == 1.0 and (wide["ratio_min"], wide["ratio_max"]) == (1.0, 1.5)
    assert wide["met"] is False and wide["bar"] == "DDP >= 1.2x gloo (cnn, wide)"
    assert wide["max_param_diff"] == 1e-7
    assert gpt["bar"] is None and gpt["met"] is None  # no DDP bar where compute dominates
    assert fsdp2["plait_s"] is None and fsdp2["peer_s"] == 3.0 and fsdp2["ratio"] is None
    assert fsdp2["met"] is None
    assert fsdp2["failed"] == {"plait": "rank 1: RuntimeError: no reduce_scatter"}


def test_a_failed_way_shows_its_error_not_a_figure(capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"runs": [RUN], "summary": tables.summarize([RUN]), "load": [1.0, 2.0]}
    done = tables.report(doc, TorchBackendBenchConfig())
    render.show(done)
    out = capsys.readouterr().out
    assert 'wide FSDP2 step on "plait": failed: rank 1: RuntimeError: no reduce_scatter' in out
    assert "bars (issue 32) met: 1 of 3" in out and "largest difference 1.0e-07" in out
    md = render.markdown(done.markdown)
    assert (
        "| 4 | wide | FSDP2 step | failed | 3000.00 ms |  |  | FSDP2 >= 1.5x gloo | no figure |"
        in md
    )


def test_the_bars_are_issue_32s() -> None:
    assert bar_for("gloo", "ddp", "cnn") is not None and bar_for("gloo", "ddp", "gpt") is None
    fsdp2 = bar_for("gloo", "fsdp2", "gpt")
    assert fsdp2 is not None and fsdp2.at_least == 1.5
    nccl = bar_for("nccl", "ddp", "gpt")  # plait within 5% of nccl: nccl / plait >= 1/1.05
    assert nccl is not None and 1 / nccl.at_least == pytest.approx(1.05)
    assert bar_for("nccl", "fsdp2", "gpt") is None


def test_fsdp2_units_are_the_blocks_or_the_layers_with_parameters() -> None:
    from plait.train.gpt import GPT, GPTConfig

    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert wrapping._units(mlp) == [mlp[1], mlp[3]]
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=16))
    assert wrapping._units(gpt) == list(gpt.blocks)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"measures": "ddp,zero"}, "unknown measures ['zero']"),
        ({"workloads": "resnet"}, "unknown workloads ['resnet']"),
        ({"nproc": "3", "global_batch": 8}, "--global-batch 8 % 3 ranks = 2"),
        ({"calls": 0}, "--calls must be >= 1; got 0"),
        ({"warmup": -1}, "--warmup must be >= 0; got -1"),
        ({"device": "gpu"}, "--device must be one of cpu, cuda; got 'gpu'"),
    ],
)
def test_bad_values_show_the_failing_check(options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        TorchBackendBenchConfig(**options)
    assert says in str(info.value)

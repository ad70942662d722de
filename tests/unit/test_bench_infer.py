"""`plait bench infer`: its config's checks, the runs it plans, turn-taking on fake calls, and
the bars on made-up figures (one tiny real run is in tests/e2e/test_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.bench.infer import runs as infer_runs
from plait.bench.infer import tables
from plait.bench.infer.config import InferBenchConfig
from plait.errors import ConfigError


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"models": "mlp,resnet"}, "unknown models ['resnet']; expected a subset of mlp, cnn, gpt"),
        ({"workers_list": "1,x"}, "--workers-list must be comma-separated integers; got '1,x'"),
        ({"workers_list": "0,2"}, "--workers-list values must be >= 1; got '0,2'"),
        ({"steps_scale": 0.0}, "--steps-scale must be > 0"),
        ({"steps_scale": -1.0}, "got -1.0"),
        ({"calls": 0}, "--calls must be >= 1; got 0"),
        ({"threads": 0}, "--threads must be >= 1; got 0"),
        ({"weight": 1.5}, "--weight must be in [0, 1]; got 1.5"),
        ({"text_temperature": 0.0}, "--text-temperature must be > 0"),
    ],
)
def test_bad_options_say_what_was_expected(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        InferBenchConfig(**options)
    assert says in str(info.value)


def test_a_teacher_brings_its_student_alone_and_distilled() -> None:
    names = [r.name for r in infer_runs.plan(InferBenchConfig(models="mlp"))]
    assert names == ["mlp"]
    runs = infer_runs.plan(InferBenchConfig(models="cnn,gpt"))
    assert [(r.name, r.variants, r.teacher) for r in runs] == [
        ("cnn", True, None), ("mlp", False, None), ("gpt", True, None),
        ("gpt-small", False, None), ("mlp-distilled", False, "cnn"),
        ("gpt-small-distilled", False, "gpt"),
    ]  # fmt: skip
    assert infer_runs.plan(InferBenchConfig(models="cnn,mlp"))[1].variants  # named: all three


def test_train_args_scale_the_recipe_and_name_the_teacher(tmp_path: Path) -> None:
    config = InferBenchConfig(models="gpt", steps_scale=0.1, text_temperature=3, text_weight=0.25)
    student = infer_runs.plan(config)[-1]
    args = infer_runs.train_args(student, config, tmp_path)
    assert args == ["--model", "gpt-small", "--workers", "2", "--steps", "36",
                    "--warmup-steps", "4", "--teacher", str(tmp_path / "gpt"),
                    "--distill-temperature", "3.0", "--distill-weight", "0.25"]  # fmt: skip
    mlp = infer_runs.plan(InferBenchConfig(models="mlp"))[0]
    tiny = infer_runs.train_args(mlp, InferBenchConfig(steps_scale=1e-6), tmp_path)
    assert "--warmup-steps" not in tiny


def test_a_run_is_reused_only_with_a_checkpoint_and_the_same_options(tmp_path: Path) -> None:
    args = ["--model", "mlp", "--steps", "3"]
    assert not infer_runs.reusable(tmp_path, args)
    (tmp_path / infer_runs.OPTIONS_FILE).write_text(json.dumps(args))
    assert not infer_runs.reusable(tmp_path, args)  # no checkpoint
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert infer_runs.reusable(tmp_path, args)
    assert not infer_runs.reusable(tmp_path, [*args[:-1], "4"])


def test_in_turns_rotates_the_order_and_times_each_call() -> None:
    from plait.bench.infer.timings import in_turns, quantile

    log: list[tuple[str, int]] = []
    now = [0.0]
    cost = {"fp32": 3.0, "int8": 1.0, "bf16": 5.0}

    def call(name: str) -> Any:
        def go(i: int) -> None:
            log.append((name, i))
            now[0] += cost[name]

        return go

    took = in_turns({n: call(n) for n in cost}, rounds=3, warmup=1, clock=lambda: now[0])
    assert log == [("fp32", 0), ("int8", 0), ("bf16", 0),  # warm-up, untimed
                   ("int8", 1), ("bf16", 1), ("fp32", 1),
                   ("bf16", 2), ("fp32", 2), ("int8", 2),
                   ("fp32", 3), ("int8", 3), ("bf16", 3)]  # fmt: skip
    assert took == {n: [c] * 3 for n, c in cost.items()}
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0 and quantile([1.0, 9.0], 0.99) == 9.0


def row(run: str, variant: str, params: int, p50: float, metric: float) -> dict[str, Any]:
    return {"run": run, "variant": variant, "parameters": params, "latency_p50_ms": p50,
            "metric": metric, "metric_name": "held-out accuracy",
            "examples_per_s_repeats": [1.0]}  # fmt: skip


def test_the_bars_pass_and_miss_on_made_up_figures() -> None:
    good = [row("gpt", "fp32", 867_072, 6.0, 1.50), row("gpt", "int8", 867_072, 3.0, 1.52),
            row("cnn", "fp32", 38_282, 0.2, 0.980), row("mlp", "fp32", 9_610, 0.1, 0.960),
            row("mlp-distilled", "fp32", 9_610, 0.1, 0.975)]  # fmt: skip
    fast = {"gpt": {"examples_per_s": {1: [100.0, 110.0], 2: [180.0, 200.0]}}}
    assert [b["status"] for b in tables.bars(good, fast)] == ["PASS"] * 3
    assert "2.00x" in tables.bars(good, fast)[0]["figure"]

    bad = [dict(r) for r in good]
    bad[1]["metric"] = 1.56  # int8 loses 0.06 nats/byte: fast enough, not accurate enough
    bad[4]["metric"] = 0.955  # the student is worse than alone (and within 1 point)
    slow = {"gpt": {"examples_per_s": {1: [100.0], 2: [160.0]}}}
    assert [b["status"] for b in tables.bars(bad, slow)] == ["MISS"] * 3

    big = [dict(r) for r in good]
    big[4]["parameters"] = 20_000  # more than half the teacher's
    assert tables.student_bar(big)["status"] == "MISS"
    far = [dict(r) for r in good]
    far[2]["metric"] = 0.990  # the teacher 1.5 points above the student
    assert tables.student_bar(far)["status"] == "MISS"
    assert [b["status"] for b in tables.bars([], {})] == ["n/a"] * 3

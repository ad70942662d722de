"""The benchmarks' configs (one source of defaults for CLI and workers), the JSON hand-off to
the workers, what every benchmark shares (paired ratios, the ways' turns, the report's
sections and Markdown), and the runner. No process is spawned."""

from __future__ import annotations

import sys

import pytest

from plait.bench import render, runner, stats, turns, workers
from plait.bench.collectives.config import CollectivesConfig
from plait.bench.comm.config import CommBenchConfig
from plait.bench.p2p.config import P2PConfig
from plait.bench.pipeline.config import PipelineBenchConfig
from plait.bench.ps.config import PsBenchConfig
from plait.bench.registry import BENCHMARKS
from plait.bench.render import Line, Report, Table
from plait.bench.train.config import TrainBenchConfig
from plait.cli.main import build_parser
from plait.errors import ConfigError
from plait.options import from_args


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_command_line_defaults_are_the_configs(name: str) -> None:
    cls = BENCHMARKS[name]
    assert from_args(cls, build_parser().parse_args(["bench", name])) == cls()


def test_options_reach_the_config_under_every_flag() -> None:
    ns = build_parser().parse_args(["bench", "collectives", "-n", "3", "--sizes", "8K",
                                    "--calibrate", "--json", "f.json"])  # fmt: skip
    assert from_args(CollectivesConfig, ns) == CollectivesConfig(
        nproc=3, sizes="8K", calibrate=True, json="f.json"
    )
    ns = build_parser().parse_args(["bench", "train", "--nproc", "2", "--global-batch", "6"])
    assert from_args(TrainBenchConfig, ns) == TrainBenchConfig(nproc="2", global_batch=6)
    with pytest.raises(SystemExit):  # a field kept off the command line
        build_parser().parse_args(["bench", "train", "--warmup", "1"])


@pytest.mark.parametrize(
    ("cls", "options", "says"),
    [
        (CollectivesConfig, {"algorithms": "ring,fastest"}, "unknown algorithms ['fastest']"),
        (CollectivesConfig, {"link_rate": "1gbit"}, "add --hosts H"),
        (CollectivesConfig, {"sizes": "4K,6"}, "multiple of 4"),
        (P2PConfig, {"nproc": 3}, "-n must be an even number >= 2 (ranks pair up); got 3"),
        (P2PConfig, {"repeats": 0}, "--repeats must be >= 1; got 0"),
        (TrainBenchConfig, {"nproc": "2,x"}, "--nproc must be comma-separated integers"),
        (TrainBenchConfig, {"nproc": "3", "global_batch": 8}, "--global-batch 8 % 3 ranks = 2"),
        (TrainBenchConfig, {"workloads": "resnet"}, "unknown workloads ['resnet']"),
        (PsBenchConfig, {"configs": "ps bsp"}, "unknown configs ['ps bsp']"),
        (PsBenchConfig, {"straggler": 0.5}, "--straggler must be >= 1"),
        (
            PsBenchConfig,
            {"straggler_mode": "sometimes"},
            "--straggler-mode must be one of persistent, transient; got 'sometimes'",
        ),
        (PipelineBenchConfig, {"stages": "9"}, "--stages 9 > --layers 8: a stage would be empty"),
        (PipelineBenchConfig, {"chunks": "2", "batch": 1}, "--chunks 2 > --batch 1"),
        (PipelineBenchConfig, {"schedules": "zb"}, "unknown schedules ['zb']"),
        (PipelineBenchConfig, {"warmup": -1}, "--warmup must be >= 0; got -1"),
        (CommBenchConfig, {"ways": "fifo,lifo"}, "way 'lifo' is not one of fifo, priority"),
        (CommBenchConfig, {"hosts": 3, "global_batch": 64}, "--global-batch 64 % 6 ranks"),
        (CommBenchConfig, {"slice_mb": 0}, "--slice-mb must be > 0; got 0"),
    ],
)
def test_bad_values_show_the_failing_check(cls: type, options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**options)
    assert says in str(info.value)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_worker_gets_the_whole_config(name: str, tmp_path) -> None:
    config = BENCHMARKS[name](repeats=2)  # every benchmark has repeats: not a default
    cmd = workers.command(name, config, tmp_path / "out.json", "--baseline")
    assert cmd[:4] == [sys.executable, "-m", "plait.bench.workers", name]
    got, out, extra = workers.read(BENCHMARKS[name], cmd[4:])
    assert got == config and out == tmp_path / "out.json" and extra == ["--baseline"]


def test_parsed_lists() -> None:
    assert CollectivesConfig(sizes="4K,1M").size_list == [4096, 1 << 20]
    assert TrainBenchConfig(nproc="1,2", global_batch=4).world_sizes == [1, 2]
    c = PipelineBenchConfig(stages="1,2", chunks="3", schedules="1f1b")
    assert (c.stage_list, c.chunk_list, c.schedule_list) == ([1, 2], [3], ["1f1b"])


def test_paired_ratio_is_the_median_of_per_repeat_ratios() -> None:
    # per repeat 1/1, 4/2, 9/9 -> 1, 2, 1: median 1; the ratio of the medians would be 2
    assert stats.paired_ratios([1.0, 4.0, 9.0], [1.0, 2.0, 9.0]) == [1.0, 2.0, 1.0]
    assert stats.paired_ratio([1.0, 4.0, 9.0], [1.0, 2.0, 9.0]) == 1.0
    with pytest.raises(ValueError):  # repeats must pair up
        stats.paired_ratio([1.0, 2.0], [1.0])
    assert stats.median_or_none([None, 3, 1, None, 2]) == 2
    assert stats.median_or_none([None]) is None
    assert (render.ratio(1.234), render.ratio(None)) == ("1.23x", "")


def test_sections_fall_where_the_group_changes() -> None:
    t = render._rich(Table("", ["a"], [(1, ["x"]), (1, ["y"]), (2, ["z"]), (3, ["w"])], left="a"))
    assert [row.end_section for row in t.rows] == [False, True, True, False]


def test_markdown_is_each_table_then_each_line_a_blank_line_apart() -> None:
    text = render.markdown([Table("title", ["a", "b"], [(1, ["1", "2"]), (2, ["3", "4"])], "a"),
                            Line("after")])  # fmt: skip
    assert text == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nafter"


def test_the_ways_take_turns_shuffled_by_round_or_rotated() -> None:
    ran: list[tuple[str, int]] = []

    def run(way: str, r: int) -> int:
        ran.append((way, r))
        return 10 * r + len(way)

    took = turns.take_turns(["a", "bb", "ccc"], 3, run)
    for r in range(3):  # every way once a round, in random.Random(r)'s order
        assert ran[3 * r : 3 * r + 3] == [(w, r) for w in turns.shuffled(["a", "bb", "ccc"], r)]
    assert took == {"a": [1, 11, 21], "bb": [2, 12, 22], "ccc": [3, 13, 23]}
    assert turns.shuffled(["a", "b", "c", "d"], 1, seed=4) == turns.shuffled(
        ["a", "b", "c", "d"], 5
    )
    ran.clear()
    took = turns.take_turns(["a", "bb"], 2, run, order=turns.rotated, warmup=1)
    assert ran == [("a", 0), ("bb", 0), ("bb", 1), ("a", 1), ("a", 2), ("bb", 2)]
    assert took == {"a": [11, 21], "bb": [12, 22]}  # the warm-up round is not kept


def test_the_runner_prints_the_report_its_markdown_then_writes_the_json(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    def measure(config: P2PConfig) -> dict:
        return {"n": config.repeats}

    def report(doc: dict, config: P2PConfig) -> Report:
        table = Table("t", ["x"], [(None, [str(doc["n"])])], "x")
        return Report([table, Line("said", to="stderr")], markdown=[table], status=3)

    config = P2PConfig(repeats=4, markdown=True, json=str(tmp_path / "out.json"))
    assert runner.run(runner.Benchmark(measure, report), config) == 3
    out, err = capsys.readouterr()
    assert "│ 4 │" in out and out.endswith("| x |\n|---|\n| 4 |\n") and err == "said\n"
    assert workers.load(tmp_path / "out.json") == {"n": 4}


def test_the_algorithms_benchmarked_are_the_routing_tables() -> None:
    # the command line does not import torch (the routing table does) for the default, all
    from plait.bench.collectives.config import algorithms
    from plait.comm.dispatch import routes

    auto, *rows = routes.ACCEPTED["allreduce"]
    assert CollectivesConfig().algorithm_list == algorithms() == ["torch", *rows, auto]

"""The benchmarks' configs (one source of defaults for CLI and workers), the JSON hand-off to
the workers, and the shared report: paired ratios, sections, Markdown. No process is spawned."""

from __future__ import annotations

import sys

import pytest
from rich.table import Table

from plait.bench import report, worker_io
from plait.bench.configs import (
    BENCHMARKS,
    CollectivesConfig,
    CommBenchConfig,
    P2PConfig,
    PipelineBenchConfig,
    PsBenchConfig,
    TrainBenchConfig,
)
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
    cmd = worker_io.command(f"plait.bench.{name}", config, tmp_path / "out.json", "--baseline")
    assert cmd[:3] == [sys.executable, "-m", f"plait.bench.{name}"]
    got, out, extra = worker_io.read(BENCHMARKS[name], cmd[3:])
    assert got == config and out == tmp_path / "out.json" and extra == ["--baseline"]


def test_parsed_lists() -> None:
    assert CollectivesConfig(sizes="4K,1M").size_list == [4096, 1 << 20]
    assert TrainBenchConfig(nproc="1,2", global_batch=4).world_sizes == [1, 2]
    c = PipelineBenchConfig(stages="1,2", chunks="3", schedules="1f1b")
    assert (c.stage_list, c.chunk_list, c.schedule_list) == ([1, 2], [3], ["1f1b"])


def test_paired_ratio_is_the_median_of_per_repeat_ratios() -> None:
    # per repeat 1/1, 4/2, 9/9 -> 1, 2, 1: median 1; the ratio of the medians would be 2
    assert report.paired_ratios([1.0, 4.0, 9.0], [1.0, 2.0, 9.0]) == [1.0, 2.0, 1.0]
    assert report.paired_ratio([1.0, 4.0, 9.0], [1.0, 2.0, 9.0]) == 1.0
    with pytest.raises(ValueError):  # repeats must pair up
        report.paired_ratio([1.0, 2.0], [1.0])
    assert report.median_or_none([None, 3, 1, None, 2]) == 2
    assert report.median_or_none([None]) is None
    assert (report.ratio(1.234), report.ratio(None)) == ("1.23x", "")


def test_sections_fall_where_the_group_changes() -> None:
    t = Table()
    t.add_column("a")
    report.add_rows(t, [(1, ["x"]), (1, ["y"]), (2, ["z"]), (3, ["w"])])
    assert [row.end_section for row in t.rows] == [False, True, True, False]


def test_markdown_table() -> None:
    text = report.markdown(["a", "b"], [["1", "2"], ["3", "4"]])
    assert text == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"


def test_the_algorithms_benchmarked_are_the_routing_tables() -> None:
    # units.ALGORITHMS is spelled out so that the CLI parses without torch; it must name
    # exactly the allreduce rows of the routing table (plus "auto" and the peer, "torch")
    from plait.bench.units import ALGORITHMS
    from plait.comm.dispatch import routes

    assert set(ALGORITHMS) == {"torch", *routes.ACCEPTED["allreduce"]}

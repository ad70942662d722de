"""`plait run`'s options: derived from RunConfig, its checks, and the command each rank runs.
No process is spawned (tests/e2e/test_launch.py runs real jobs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plait.cli.main import build_parser
from plait.errors import ConfigError
from plait.launch.config import RunConfig
from plait.launch.job import check_discovery_script, command
from plait.options import given


def test_the_command_line_gives_the_options() -> None:
    ns = build_parser().parse_args(["run", "-n", "3", "-m", "pkg.mod", "-n", "x", "--flag"])
    assert given(ns, RunConfig) == {"nproc": 3, "module": True}
    # everything after SCRIPT belongs to the script, -n included
    assert (ns.script, ns.script_args) == ("pkg.mod", ["-n", "x", "--flag"])
    assert given(build_parser().parse_args(["run", "s.py"]), RunConfig) == {}


def test_horovods_elastic_flags_are_plait_runs() -> None:
    argv = ["run", "-n", "2", "--min-num-proc", "1", "--max-num-proc", "3",
            "--host-discovery-script", "./d.sh", "--slots", "2", "--reset-limit", "4",
            "--blacklist-cooldown-range", "10", "100", "x.py"]  # fmt: skip
    config = RunConfig(**given(build_parser().parse_args(argv), RunConfig), script="x.py")
    assert (config.min_np, config.max_np, config.slots_per_host, config.reset_limit) == (1, 3, 2, 4)
    assert config.host_discovery_script == "./d.sh"
    assert config.blacklist_cooldown_range == (10, 100)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"nproc": 0}, "-n/--nproc must be at least 1, got 0"),
        ({"servers": -1}, "--servers must be at least 0, got -1"),
        ({"keep_going_on_worker_failure": True}, "needs --servers S"),
        ({"master_port": 70000}, "--master-port must be in 1..65535, got 70000"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank must be in 0..1 (--nnodes 2), got 2"),
        ({"nnodes": 2, "master_port": 1}, "--nnodes 2 needs --master-addr:"),
        ({"nnodes": 2}, "needs --master-addr and --master-port"),
        (
            {"nnodes": 2, "master_addr": "h", "master_port": 1, "servers": 1},
            "export PLAIT_SERVERS=S",
        ),
    ],
)
def test_bad_options_show_the_failing_check(options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(script="s.py", **options)
    assert says in str(info.value)


def test_each_rank_runs_the_script_or_the_module(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    assert command(RunConfig(script=str(script), script_args=["a"])) == [
        sys.executable, str(script), "a"
    ]  # fmt: skip
    assert command(RunConfig(script="pkg.mod", module=True)) == [sys.executable, "-m", "pkg.mod"]
    with pytest.raises(ConfigError, match=r"use `plait run -m pkg\.mod`"):
        command(RunConfig(script="pkg.mod"))
    with pytest.raises(ConfigError, match=r"\(a directory"):
        command(RunConfig(script=str(tmp_path)))


def test_a_discovery_script_must_be_a_command_the_shell_can_run(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("echo localhost:2\n")
    with pytest.raises(ConfigError, match=f"{script} is not executable: `chmod \\+x {script}`"):
        check_discovery_script(str(script))
    check_discovery_script(f"sh {script}")  # a command on PATH, given the file
    script.chmod(0o755)
    check_discovery_script(str(script))
    with pytest.raises(ConfigError, match=r"no such file or command 'nope/d\.sh'"):
        check_discovery_script("nope/d.sh --flag")

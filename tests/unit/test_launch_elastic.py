"""`plait run --min-np N` and its other elastic options (launch/elastic.py): the options'
checks, the driver's decisions as discovery answers and ranks fail (discovery's answers
and the clock given by the test), and the launcher keeping the job going while at least N
ranks live (real processes: each a one-line Python command)."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.errors import ConfigError
from plait.launch.config import RunConfig
from plait.launch.discovery import Failed, Found
from plait.launch.elastic import Driver, ElasticOptions
from plait.launch.local import launch
from plait.launch.slots import Changes, Live
from support.paths import LAUNCH_SCRIPTS

FAIL_RANK_1 = [
    sys.executable,
    "-c",
    "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)",
]
SCHEDULE = LAUNCH_SCRIPTS / "discover_schedule.sh"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"nproc": 2, "min_np": 3}, "--min-np must be in 1..2"),
        ({"nproc": 2, "min_np": 0}, "--min-np must be in 1..2"),
        ({"nproc": 2, "host_discovery_script": "d", "servers": 1}, "not with --host-discovery"),
        ({"nproc": 2, "min_np": 1, "max_np": 2, "servers": 1}, "not with --host-discovery"),
        (
            {"nproc": 2, "min_np": 1, "servers": 1, "keep_going_on_worker_failure": True},
            "--keep-going-on-worker-failure and --min-np both say which workers may fail",
        ),
        (
            {
                "nproc": 2,
                "host_discovery_script": "d",
                "nnodes": 2,
                "master_addr": "h",
                "master_port": 1,
            },
            "not with --nnodes yet",
        ),
        ({"nproc": 4, "min_np": 2, "max_np": 3}, "--max-np 3 < -n 4: -n ranks start the job"),
        ({"max_np": 3}, "--max-np is for an elastic job: give --min-np N or"),
        ({"reset_limit": 3}, "--reset-limit is for an elastic job"),
        ({"min_np": 1, "slots_per_host": 2}, "--slots-per-host is about discovered hosts"),
        ({"min_np": 1, "blacklist_cooldown_range": (1, 2)}, "it needs --host-discovery-script"),
        ({"min_np": 1, "elastic_timeout": 5}, "--elastic-timeout is about discovered hosts"),
        ({"host_discovery_script": "d", "reset_limit": -1}, "--reset-limit must be at least 0"),
        ({"host_discovery_script": "d", "slots_per_host": 0}, "at least 1, got 0"),
        (
            {"host_discovery_script": "d", "blacklist_cooldown_range": [5, 4000]},
            "expected MIN MAX with 1 <= MIN <= MAX <= 3600",
        ),
    ],
)
def test_bad_elastic_options_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        RunConfig(script="x.py", **kwargs)


def test_a_discovery_script_makes_the_job_elastic_with_min_np_at_n() -> None:
    config = RunConfig(script="x.py", nproc=3, host_discovery_script="d")
    assert (config.elastic, config.least_np) == (True, 3)  # horovodrun's default
    assert RunConfig(script="x.py", nproc=3).least_np is None


class Answers:
    """Discovery's answers, handed out in order."""

    def __init__(self, *results: Found | Failed) -> None:
        self.results = list(results)

    def next(self, timeout: float) -> Found | Failed | None:
        return self.results.pop(0) if self.results else None

    def close(self) -> None:
        pass


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def driver(min_np: int = 1, **options: Any) -> tuple[Driver, io.StringIO, Clock]:
    err, clock = io.StringIO(), Clock()
    d = Driver(ElasticOptions(script="d", **options), min_np, err, clock)
    d.discovery = Answers(Found({"localhost": 2}))
    assert not d.tick(on("localhost", 0, 1))  # the first ranks' hosts: nothing to change
    d.next_rank = 2
    return d, err, clock


def on(host: str, *ranks: int) -> list[Live]:
    return [Live(r, host) for r in ranks]


def test_joiners_start_as_hosts_come_and_ranks_stop_as_they_go() -> None:
    d, err, _ = driver(max_np=3)
    d.discovery = Answers(Found({"localhost": 2, "127.0.0.1": 2}))
    assert d.tick(on("localhost", 0, 1)) == Changes(start=((2, "127.0.0.1"),))
    d.discovery = Answers(Found({"127.0.0.1": 2}))
    got = d.tick(on("localhost", 0, 1) + on("127.0.0.1", 2))
    assert got == Changes(stop=(0, 1), start=((3, "127.0.0.1"),))
    # (the lines said are the e2e test's, tests/e2e/test_elastic_discovery.py)
    assert "plait run: reset 2: ranks 0, 1 stopped, rank 3 joining; 2 rank(s) now" in err.getvalue()
    assert (
        d.recap()
        == "elastic job: 2 reset(s); joined: ranks 2, 3; stopped for discovery: ranks 0, 1"
    )


def test_a_failed_ranks_host_gets_no_new_rank_until_its_cooldown_ends() -> None:
    d, err, clock = driver(cooldown=(1, 2))
    assert d.lost(1, "rank 1", "localhost", "exit code 3", left=1)
    assert not d.tick(on("localhost", 0))  # its slot stays empty
    assert "host localhost blacklisted for " in err.getvalue()
    assert "reset 1: rank 1 failed; 1 rank(s) now" in err.getvalue()
    clock.now = 2.0  # the range's MAX
    assert d.tick(on("localhost", 0)) == Changes(start=((2, "localhost"),))
    assert "host localhost's blacklist cooldown is over: it may get ranks again" in err.getvalue()


def test_past_the_reset_limit_the_job_ends() -> None:
    d, err, _ = driver(reset_limit=1)
    d.lost(1, "rank 1", "localhost", "exit code 3", left=1)
    d.tick(on("localhost", 0))
    assert d.ended is None and "reset 1 of --reset-limit 1: rank 1 failed" in err.getvalue()
    d.discovery = Answers(Found({"localhost": 2, "127.0.0.1": 1}))
    assert not d.tick(on("localhost", 0))  # nobody starts: the job ends instead
    assert (d.ended, d.status) == (
        "reset 2 (membership change) is one more than --reset-limit 1: stopping the job",
        1,
    )


@pytest.mark.parametrize(
    ("hosts", "min_np", "ended"),
    [
        ({"127.0.0.1": 2}, 1, "discovery leaves none of the running ranks: the joiners would"),
        ({}, 1, "discovery leaves 0 rank(s), fewer than --min-np 1: stopping the job"),
        ({"localhost": 1}, 2, "discovery leaves 1 rank(s), fewer than --min-np 2"),
    ],
)
def test_discovery_may_not_take_the_job_below_what_it_needs(
    hosts: dict[str, int], min_np: int, ended: str
) -> None:
    d, _, _ = driver(min_np=min_np)
    d.discovery = Answers(Found(hosts))
    assert not d.tick(on("localhost", 0, 1))
    assert d.ended is not None and d.ended.startswith(ended)


def test_a_finishing_job_starts_no_joiner() -> None:
    d, _, _ = driver()
    d.finishing = True
    d.discovery = Answers(Found({"localhost": 2, "127.0.0.1": 1}))
    assert not d.tick(on("localhost", 1))


def test_discovery_may_fail_for_a_while_but_not_for_the_timeout() -> None:
    d, err, clock = driver(timeout_s=600)
    d.discovery = Answers(Failed("ended with exit code 1"), Failed("ended with exit code 1"))
    assert not d.tick(on("localhost", 0, 1))  # the last hosts are kept
    said = "plait run: host discovery failed: d ended with exit code 1; keeping the last hosts"
    assert err.getvalue().count(said) == 1  # the same reason once
    d.discovery = Answers(Found({"localhost": 2}))
    d.tick(on("localhost", 0, 1))
    assert "host discovery works again after 2 failed run(s)" in err.getvalue()
    d.discovery = Answers(Failed("timed out"))
    d.tick(on("localhost", 0, 1))
    clock.now = 601.0
    d.discovery = Answers(Failed("timed out"))
    d.tick(on("localhost", 0, 1))
    assert d.ended == (
        "host discovery has failed for 601 s in a row (--elastic-timeout 600): stopping the job"
    )


class NoSignal:
    first = None


@pytest.mark.parametrize(
    ("lines", "status", "says"),
    [
        ("fail\n", 2, "the host discovery script failed on its first run: sh "),
        (
            "localhost:2 192.0.2.1:4\n",
            2,
            "discovery reports hosts that are not this machine: "
            "192.0.2.1. plait run starts ranks on this machine only",
        ),
        (
            "localhost:1\nlocalhost:1 127.0.0.1:3\n",
            0,
            "starting 3 rank(s): rank 0 on localhost, ranks 1, 2 on 127.0.0.1",
        ),
    ],
)
def test_the_start_waits_for_n_slots_from_a_working_script(
    tmp_path: Path, lines: str, status: int, says: str
) -> None:
    (tmp_path / "s").write_text(lines)
    err = io.StringIO()
    options = ElasticOptions(script=f"sh {SCHEDULE} {tmp_path / 's'}", max_np=3, period_s=0.01)
    d = Driver(options, 2, err)
    try:
        hosts = d.first_hosts(2, NoSignal())
    finally:
        d.close()
    assert d.status == status and says in err.getvalue(), err.getvalue()
    if status == 0:
        assert hosts == ["localhost", "127.0.0.1", "127.0.0.1"] and d.next_rank == 3
        assert "waiting for 2 slots (-n 2): discovery offers 1" in err.getvalue()


@pytest.mark.parametrize(("min_alive", "status"), [(2, 0), (3, 3)])
def test_a_failing_rank_stops_the_job_only_below_min_np(min_alive: int, status: int) -> None:
    err = io.StringIO()
    got = launch(FAIL_RANK_1, 3, min_alive=min_alive, stdout=io.StringIO(), stderr=err)
    assert got == status, err.getvalue()
    goes_on = "rank 1 failed (exit code 3); the job goes on without it"
    stops = "rank 1 failed (exit code 3); 2 rank(s) left, fewer than --min-np 3"
    assert (goes_on in err.getvalue(), stops in err.getvalue()) == (status == 0, status != 0)


def test_the_launcher_ends_a_job_past_its_reset_limit(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("localhost:2\n")
    err = io.StringIO()
    options = ElasticOptions(script=f"sh {SCHEDULE} {tmp_path / 's'}", reset_limit=0)
    sleepy = [*FAIL_RANK_1[:2], FAIL_RANK_1[2] + "; import time; time.sleep(30)"]
    got = launch(sleepy, 2, min_alive=1, elastic=options, stdout=io.StringIO(), stderr=err)
    assert got == 1, err.getvalue()
    assert err.getvalue().splitlines()[-4:] == [
        "plait run: host localhost blacklisted: rank 1 failed there, so no new rank starts there",
        "plait run: reset 1 (membership change) is one more than --reset-limit 0: stopping the job",
        "plait run: elastic job: 1 reset(s) (limit 0); failed: rank 1; blacklisted: localhost",
        "plait run: stopped all 2 rank(s)",
    ]

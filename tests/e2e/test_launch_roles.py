"""`plait run --servers`: each role's prefixes, and who may fail without stopping the job
(workers with --keep-going-on-worker-failure or --min-np; never servers). Each role's
environment is in tests/unit/test_rank_env.py."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest

from plait.launch import launch
from support.commands import plait_run
from support.paths import LAUNCH_SCRIPTS

SCRIPT = LAUNCH_SCRIPTS / "roles.py"


def _envs(stdout: str) -> dict[str, dict[str, str]]:
    found = re.findall(r"^(\[(?:rank|server) \d+\]) env (.*)$", stdout, re.M)
    return {prefix: dict(kv.split("=", 1) for kv in line.split()) for prefix, line in found}


@pytest.mark.timeout(60)
def test_workers_and_servers_get_their_roles() -> None:
    res = plait_run("-n", "2", "--servers", "2", str(SCRIPT))
    assert res.returncode == 0, res.stderr
    envs = _envs(res.stdout)
    assert set(envs) == {"[rank 0]", "[rank 1]", "[server 0]", "[server 1]"}
    for prefix, kv in envs.items():
        role, index = prefix.strip("[]").split()
        assert kv["WORLD_SIZE"] == "4" and kv["PLAIT_SERVERS"] == "2"
        assert kv["ROLE_NAME"] == ("server" if role == "server" else "worker")
        assert kv["ROLE_RANK"] == index and kv["ROLE_WORLD_SIZE"] == "2"
        assert int(kv["RANK"]) == int(index) + (2 if role == "server" else 0)


@pytest.mark.timeout(60)
def test_a_survivable_worker_fails_and_the_job_goes_on() -> None:
    out, err = io.StringIO(), io.StringIO()
    cmd = [sys.executable, str(SCRIPT), "1", "2.0"]  # rank 1 raises; the others sleep 2 s
    code = launch(cmd, 3, servers=1, survivable=range(3), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert "plait run: rank 1 (worker 1) failed (exit code 1); the job goes on" in err.getvalue()
    for name in ("[rank 0]", "[rank 2]", "[server 0]"):  # the others ran to their end
        assert re.search(rf"^{re.escape(name)} done \d$", out.getvalue(), re.M), out.getvalue()
    assert "its traceback" not in err.getvalue()
    # through the command line: the same, and the flag needs servers
    res = plait_run("-n", "2", "--servers", "1", "--keep-going-on-worker-failure",
                    str(SCRIPT), "0", "1.0")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "rank 0 (worker 0) failed (exit code 1); the job goes on" in res.stderr
    assert "[rank 1] done 1" in res.stdout and "[server 0] done 2" in res.stdout
    res = plait_run("-n", "2", "--keep-going-on-worker-failure", str(SCRIPT))
    assert res.returncode == 2 and "needs --servers S" in res.stderr


@pytest.mark.timeout(60)
def test_a_failing_server_stops_the_job() -> None:
    out, err = io.StringIO(), io.StringIO()
    cmd = [sys.executable, str(SCRIPT), "2", "60"]  # rank 2 = server 0 raises
    start = time.monotonic()
    code = launch(cmd, 2, servers=1, survivable=range(2), stdout=out, stderr=err)
    assert time.monotonic() - start < 20, "the workers were not stopped"
    assert code == 1
    text = err.getvalue()
    assert "plait run: rank 2 (server 0) failed (exit code 1); its traceback:" in text
    assert text.rstrip().endswith("RuntimeError: boom from rank 2")
    # in an elastic job (--min-np: the workers may fail) a failing server still stops it
    out, err = io.StringIO(), io.StringIO()
    code = launch(cmd, 2, servers=1, min_alive=1, stdout=out, stderr=err)
    assert code == 1 and "rank 2 (server 0) failed (exit code 1); its traceback" in err.getvalue()
    # a worker that is not survivable stops the job too
    out, err = io.StringIO(), io.StringIO()
    code = launch([sys.executable, str(SCRIPT), "0", "60"], 2, servers=1, stdout=out, stderr=err)
    assert code == 1 and "rank 0 (worker 0) failed (exit code 1); its traceback" in err.getvalue()
    with pytest.raises(ValueError, match="only workers may fail"):
        launch(cmd, 2, servers=1, survivable=[2])

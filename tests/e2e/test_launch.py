"""`plait run`: the env contract, prefixed output, failure teardown, signals, bad input."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.launch import launch
from support.commands import plait_run
from support.paths import LAUNCH_SCRIPTS as SCRIPTS


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(60)
def test_env_contract_args_and_prefixes() -> None:
    n = 3
    res = plait_run("-n", str(n), str(SCRIPTS / "print_env.py"), "a", "--flag", "x y")
    assert res.returncode == 0, res.stderr
    envs = re.findall(r"^\[rank (\d+)\] env (.*)$", res.stdout, re.M)
    assert sorted(int(r) for r, _ in envs) == list(range(n))
    ports = set()
    for r, line in envs:
        kv = dict(item.split("=", 1) for item in line.split())
        assert kv["RANK"] == kv["LOCAL_RANK"] == kv["ROLE_RANK"] == r
        assert kv["WORLD_SIZE"] == kv["LOCAL_WORLD_SIZE"] == kv["ROLE_WORLD_SIZE"] == str(n)
        assert kv["GROUP_RANK"] == "0"
        assert kv["MASTER_ADDR"] == "127.0.0.1"
        assert kv["PYTHONUNBUFFERED"] == "1"
        ports.add(int(kv["MASTER_PORT"]))
    assert len(ports) == 1 and 0 < ports.pop() < 65536
    for r in range(n):
        assert f"[rank {r}] args ['a', '--flag', 'x y']\n" in res.stdout
        assert f"[rank {r}] partial-{r}\n" in res.stdout  # a last line without newline is kept
        assert f"[rank {r}] to-stderr {r}\n" in res.stderr  # stderr stays on stderr
        assert "to-stderr" not in res.stdout


@pytest.mark.timeout(60)
def test_module_and_master_overrides() -> None:
    res = plait_run(
        "-n",
        "2",
        "--master-port",
        "29999",
        "-m",
        "launch_scripts.print_env",
        "--x",
        "1",
        cwd=SCRIPTS.parent,
    )
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert f"[rank {r}] args ['--x', '1']\n" in res.stdout
    assert res.stdout.count("MASTER_PORT=29999") == 2


def _check_failure_output(err: str, fail_rank: int, what: str, expect: str) -> None:
    banner = f"plait run: rank {fail_rank} failed ({what}); its traceback:"
    assert banner in err, err
    after = err.split(banner, 1)[1]
    assert expect in after
    assert "[rank" not in after  # nothing from the ranks follows the banner


@pytest.mark.timeout(60)
def test_raising_rank_stops_the_others() -> None:
    start = time.monotonic()
    res = plait_run("-n", "3", str(SCRIPTS / "fail_one.py"), "raise", "1")
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert elapsed < 15, f"the sleeping ranks were not stopped ({elapsed:.1f} s)"
    assert all(f"[rank {r}] started {r}" in res.stdout for r in range(3))
    _check_failure_output(res.stderr, 1, "exit code 1", "RuntimeError: boom from rank 1")
    assert res.stderr.rstrip().endswith("RuntimeError: boom from rank 1")
    assert "Traceback (most recent call last):" in res.stderr.split("its traceback:")[1]


@pytest.mark.timeout(60)
def test_killed_rank_stops_the_others() -> None:
    start = time.monotonic()
    res = plait_run("-n", "3", str(SCRIPTS / "fail_one.py"), "kill", "2")
    assert time.monotonic() - start < 15
    assert res.returncode == 128 + signal.SIGKILL
    # it raised nothing: the headline says how it ended, and no traceback follows
    summary = res.stderr.split("=" * 72, 1)[1]
    assert summary.strip() == "plait run: rank 2 was killed by SIGKILL"


@pytest.mark.timeout(60)
def test_sigkill_follows_when_sigterm_is_ignored() -> None:
    out, err = io.StringIO(), io.StringIO()
    cmd = [sys.executable, str(SCRIPTS / "fail_one.py"), "raise", "0", "ignore-term"]
    start = time.monotonic()
    code = launch(cmd, 2, grace_s=0.5, stdout=out, stderr=err)
    assert time.monotonic() - start < 15
    assert code == 1
    _check_failure_output(err.getvalue(), 0, "exit code 1", "boom from rank 0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_leaves_no_process(tmp_path: Path, sig: int, code: int) -> None:
    n = 2
    pid_file = tmp_path / "pids"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plait",
            "run",
            "-n",
            str(n),
            str(SCRIPTS / "spawn_and_sleep.py"),
            str(pid_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        pids: list[int] = []
        while len(pids) < 2 * n and time.monotonic() < deadline:
            time.sleep(0.1)
            if pid_file.exists():
                pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 * n, "the ranks did not start"
        assert all(alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == code
    assert f"got {signal.Signals(sig).name}" in err
    if sig == signal.SIGINT:  # Ctrl-C: one line, not every rank's KeyboardInterrupt traceback
        assert err.strip() == f"plait run: got SIGINT; stopped all {n} rank(s)", err
    deadline = time.monotonic() + 5  # orphaned grandchildren are reaped by init, not us
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


@pytest.mark.timeout(60)
def test_bad_input_exits_2() -> None:
    res = plait_run("-n", "2", "no_such_script.py")
    assert res.returncode == 2
    assert "expected a Python script to run, got 'no_such_script.py' (no such file" in res.stderr
    res = plait_run("-n", "0", str(SCRIPTS / "print_env.py"))
    assert res.returncode == 2
    assert "-n/--nproc must be at least 1, got 0" in res.stderr
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        launch([sys.executable, "-c", "pass"], 0)

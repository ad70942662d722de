"""`plait bench elastic`, the parent side: the elastic job and the torchrun job in turns,
each repeat one of each (ranks.py's roles), their figures (figures.py), the report
(tables.py).

The elastic job is `plait run -n N --min-np 2` (its launcher hosts the store, so any rank
may die) of `python -m plait.bench.workers elastic ... elastic FOLDER`; once the survivors
of the kill have committed, this process starts the joiner with the environment of a
joining process (PLAIT_ELASTIC_JOIN=1, the job's store, secret, WORLD_SIZE and
LOCAL_WORLD_SIZE, a RANK never used before). The torchrun job is
`torchrun --standalone --nproc-per-node N --max-restarts 1` of the same module, role
restart. Each job's events are read from its folder after it ends; a job that fails or
lacks an event is reported with why, not with a figure.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.bench import workers
from plait.bench.elastic import events, figures, tables
from plait.bench.elastic.config import MIN_NP, ElasticBenchConfig
from plait.bench.runner import Benchmark
from plait.bench.turns import rotated, take_turns
from plait.launch.env import rank_env
from plait.launch.ports import free_port

JOB_TIMEOUT_S = 420.0  # a job that has not ended by then is stopped and reported
WAYS = ("elastic", "restart")
POLL_S = 0.05  # how often the events are read while the elastic job runs


def measure(config: ElasticBenchConfig) -> dict[str, Any]:
    """{"runs": {way: [each repeat's figures, or {"failed": why}]}, "summary": the medians
    and bars, "load": the load average before and after}."""
    load = [os.getloadavg()[0]]
    jobs: dict[str, Callable[[ElasticBenchConfig], dict[str, Any]]] = {
        "elastic": _elastic_job, "restart": _restart_job
    }  # fmt: skip

    def one(way: str, r: int) -> dict[str, Any]:
        began = time.monotonic()
        got = jobs[way](config)
        print(f"{way} job {r + 1}/{config.repeats} ({time.monotonic() - began:.0f} s): "
              f"{tables.progress(way, got)}", flush=True)  # fmt: skip
        return got

    runs = take_turns(WAYS, config.repeats, one, order=rotated)
    load.append(os.getloadavg()[0])
    return {"runs": runs, "summary": tables.summarize(runs), "load": load}


def _elastic_job(config: ElasticBenchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="plait-bench-elastic-") as tmp:
        folder = Path(tmp)
        port = free_port()
        env = {**os.environ, **workers.ON_CPU, "PLAIT_JOB_SECRET": secrets.token_hex(32)}
        cmd = [sys.executable, "-m", "plait", "run", "-n", str(config.nproc), "--min-np",
               str(MIN_NP), "--master-port", str(port), "-m",
               *_worker(config, folder, "elastic")]  # fmt: skip
        err = folder / "launcher.err"
        joiner = None
        with open(folder / "launcher.out", "w") as out, open(err, "w") as errs:
            job = subprocess.Popen(cmd, env=env, stdout=out, stderr=errs, start_new_session=True)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while job.poll() is None and time.monotonic() < deadline:
                if joiner is None and _survived(folder):
                    joiner = _start_joiner(config, folder, port, env)
                time.sleep(POLL_S)
            code = _end(job)
            if joiner is not None:
                _end(joiner, grace_s=30.0)
        said = err.read_text()
        if code != 0:
            return {"failed": f"plait run exited {code}: {_tail(said)}"}
        try:
            return figures.elastic(events.read(folder), said)
        except figures.Missing as e:
            return {"failed": f"{e}: {_tail(said)}"}


def _restart_job(config: ElasticBenchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="plait-bench-restart-") as tmp:
        folder = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(config.nproc), "--max-restarts", "1", "--monitor-interval", "0.1", "-m",
               *_worker(config, folder, "restart")]  # fmt: skip
        err = folder / "torchrun.err"
        with open(folder / "torchrun.out", "w") as out, open(err, "w") as errs:
            job = subprocess.Popen(cmd, env={**os.environ, **workers.ON_CPU}, stdout=out,
                                   stderr=errs, start_new_session=True)  # fmt: skip
            code = _end(job, grace_s=JOB_TIMEOUT_S)
        said = err.read_text()
        if code != 0:
            return {"failed": f"torchrun exited {code}: {_tail(said)}"}
        try:
            return figures.restart(events.read(folder))
        except figures.Missing as e:
            return {"failed": f"{e}: {_tail(said)}"}


def _worker(config: ElasticBenchConfig, folder: Path, role: str) -> list[str]:
    """The module and arguments of a worker of `role` (after python's -m)."""
    return workers.command("elastic", config, folder / "unused.json", role, str(folder))[2:]


def _survived(folder: Path) -> bool:
    """Whether the survivors of the kill have committed a step (generation 1)."""
    return any(e["ev"] == "commit" and e["gen"] == 1 for e in events.read(folder))


def _start_joiner(
    config: ElasticBenchConfig, folder: Path, port: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """The joining process: a rank's environment, RANK a fresh id (the job's first N were
    taken), WORLD_SIZE and LOCAL_WORLD_SIZE as the first ranks had them (one host: the
    same job key), PLAIT_ELASTIC_JOIN=1 and the launcher's store."""
    n = config.nproc
    joining = rank_env(0, n, master_addr="127.0.0.1", master_port=port, base=env)
    joining.update(RANK=str(n), LOCAL_RANK=str(n), ROLE_RANK=str(n), PLAIT_ELASTIC_JOIN="1",
                   TORCHELASTIC_USE_AGENT_STORE="true")  # fmt: skip
    with open(folder / "joiner.log", "w") as log:  # the child has its own copy
        return subprocess.Popen([sys.executable, "-m", *_worker(config, folder, "join")],
                                env=joining, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _end(proc: subprocess.Popen[Any], grace_s: float = 0.0) -> int:
    """`proc`'s exit status, once it has ended: after `grace_s`, SIGTERM, then SIGKILL."""
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        return proc.wait(10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.splitlines()[-lines:])


BENCHMARK = Benchmark(measure=measure, report=tables.report)

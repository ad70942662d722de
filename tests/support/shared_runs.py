"""`plait train` runs whose end several test modules read: each started once per session.

A command run costs seconds of CPU (each of its workers imports torch), and some runs serve
the checks of more than one module: the dp x pp mesh writes the figures that
tests/e2e/test_train_mesh_command.py checks while tests/e2e/test_abuse.py watches its
listeners. Such a run is declared once, here (RUNS); tests/conftest.py loads this module as
a plugin, and a test asks the session fixture `shared_runs` for a run's end (`result`),
which starts the run if no test has yet. A module that must see the run's processes while
they live (test_abuse.py's listener watch) starts it itself (`start`).

Each run has a folder of its own, its working directory (`{dir}` in its arguments), and a
job secret of its own (PLAIT_JOB_SECRET): test_abuse.py checks that the secret appears in
nothing the run printed or wrote.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@dataclass(frozen=True)
class Run:
    """A command line: `argv` after the interpreter ("{dir}" stands for the run's folder), in
    this process's environment plus `env`, given `timeout` seconds from its start."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 200.0


@dataclass(frozen=True)
class Ended:
    """How a run ended, where it ran, and the job secret it was given."""

    returncode: int
    stdout: str
    stderr: str
    folder: Path
    secret: str


TRAIN = ("-m", "plait", "train")
OBSERVE_STEPS = 8
RUNS = {
    # tests/e2e/test_train_mesh_command.py's figures; test_abuse.py's job on a mesh
    "mesh": Run(
        (*TRAIN, "--model", "gpt", "--data", "synthetic", "--dp", "2", "--pp", "2", "--chunks",
         "4", "--schedule", "1f1b", "--steps", "4", "--batch-size", "8", "--json",
         "{dir}/run.json"),
        timeout=140,
    ),
    # tests/e2e/test_train_precision_command.py's figures (the parameter server takes bf16
    # and checkpointing: its workers do the arithmetic); test_abuse.py's parameter server
    "ps precision": Run(
        (*TRAIN, "--strategy", "ps", "--workers", "2", "--servers", "1", "--model", "gpt",
         "--data", "synthetic", "--steps", "3", "--batch-size", "4", "--precision", "bf16",
         "--activation-checkpointing", "--json", "{dir}/run.json"),
        timeout=280,
    ),
    # one two-worker run for what --tensorboard (where installed), --profile, --trace
    # --trace-blocks (tests/e2e/test_train_observe_command.py), --device cpu
    # (test_devices_command.py) and --optimizer lamb (test_optim_command.py) show: each
    # option's own output and figures, none of which depends on the others
    # (PLAIT_TIMEOUT: a trace merge that hangs fails within the tests' time)
    "observe": Run(
        (*TRAIN, "--model", "mlp", "--data", "synthetic", "--steps", str(OBSERVE_STEPS),
         "--workers", "2", "--log-every", "2", "--eval-every", "4", "--profile", "3:4",
         "--profile-dir", "{dir}/prof", "--trace", "{dir}/t.json", "--trace-blocks",
         "--device", "cpu", "--optimizer", "lamb", "--json", "{dir}/run.json",
         *(("--tensorboard", "{dir}/tb") if HAVE_TENSORBOARD else ())),
        env={"PLAIT_TIMEOUT": "60"},
        timeout=150,
    ),
}  # fmt: skip


class SharedRuns:
    """The session's runs of RUNS: each started at most once, its end kept for every test."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._started: dict[str, tuple[subprocess.Popen[str], Path, str, float]] = {}
        self._ended: dict[str, Ended] = {}
        self._waiting: dict[str, threading.Lock] = {key: threading.Lock() for key in RUNS}

    def start(self, key: str) -> subprocess.Popen[str]:
        """Start run `key` now unless it has started; its process."""
        with self._lock:
            if key not in self._started:
                run = RUNS[key]
                folder = self._factory.mktemp(key.replace(" ", "-"))
                secret = secrets.token_hex(32)
                proc = subprocess.Popen(
                    [sys.executable, *(a.format(dir=folder) for a in run.argv)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=folder,
                    env={**os.environ, **run.env, "PLAIT_JOB_SECRET": secret},
                )
                self._started[key] = (proc, folder, secret, time.monotonic() + run.timeout)
            return self._started[key][0]

    def result(self, key: str) -> Ended:
        """How run `key` ended (started now if no test has started it)."""
        self.start(key)
        with self._waiting[key]:
            if key not in self._ended:
                proc, folder, secret, deadline = self._started[key]
                try:
                    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                finally:
                    proc.kill()
                self._ended[key] = Ended(proc.returncode, out, err, folder, secret)
            return self._ended[key]

    def close(self) -> None:
        """End what still runs (a test that started a run failed before reading it)."""
        with self._lock:
            for proc, *_ in self._started.values():
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRuns]:
    runs = SharedRuns(tmp_path_factory)
    yield runs
    runs.close()

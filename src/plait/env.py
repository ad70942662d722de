"""Every environment variable plait reads: its name, type, default and meaning, in one table.

Code asks `env.get("PLAIT_TIMEOUT")` and receives the parsed value (or the default); a bad
value is a `ValueError` naming the variable, what it needs and what it holds. What each
variable accepts is declared in its row (its kind, and its choices, its least value or the
form of its text), and `check()` tries every row at once: each plait command that starts
workers (train, run, infer, bench) calls it first, so a bad value is one line and exit
status 2 there rather than a traceback in every worker. Values are
read when asked for, not cached at import, so a launcher or a test can set them for the
process (or its children) before the code that reads them runs. `docs/environment.md` is
generated from this table (`python -m plait.env > docs/environment.md`), and a test keeps
the two in step.

Variables of the launch contract that torchrun defines (RANK, WORLD_SIZE, MASTER_ADDR, ...)
are torchrun's and read where the rendezvous is made (comm/bootstrap/rendezvous.py); Horovod's
(HOROVOD_*) are read by the facade that copies Horovod's behaviour. This module imports
nothing but the standard library.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Var:
    """One environment variable: `kind` parses its text; `default` is used when unset or
    empty; `choices`, `low` and `form` say what it accepts besides its kind."""

    name: str
    kind: str  # "seconds", "int", "number", "flag", "text", "path"
    default: Any
    meaning: str
    group: str  # where it belongs in the docs: "communication", "launch", "test hooks", ...
    choices: tuple[str, ...] = ()  # a text's accepted values
    low: int | None = None  # an int's least value
    form: tuple[str, str] | None = None  # a text's (regular expression, as people write it)

    def accepts(self) -> str:
        """What the variable accepts, as the docs' table and the errors say it."""
        if self.choices:
            return " or ".join(", ".join(self.choices).rsplit(", ", 1))
        if self.form is not None:
            return self.form[1]
        if self.kind == "seconds":
            return "seconds > 0"
        if self.kind == "flag":
            return "0 or 1"
        if self.low is not None:
            return f"an integer >= {self.low}"
        return self.kind

    def parse(self, raw: str) -> Any:
        """The value of text `raw` (set and not empty).

        Raises:
            ValueError: naming the variable, what it accepts and what it holds.
        """
        value = _PARSE[self.kind](self.name, raw)
        bad = (
            (self.choices and value not in self.choices)
            or (self.low is not None and value < self.low)
            or (self.form is not None and re.fullmatch(self.form[0], raw) is None)
        )
        if bad:
            raise ValueError(f"{self.name} must be {self.accepts()}; got {raw!r}")
        return value


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds; got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds; got {raw!r}")
    return value


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {raw!r}") from None


def _number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number; got {raw!r}") from None


def _flag(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1; got {raw!r}")
    return raw == "1"


_PARSE: dict[str, Callable[[str, str], Any]] = {
    "seconds": _seconds,
    "int": _int,
    "number": _number,
    "flag": _flag,
    "text": lambda name, raw: raw,
    "path": lambda name, raw: raw,
}

VARIABLES: tuple[Var, ...] = (
    # communication
    Var("PLAIT_TIMEOUT", "seconds", 1800.0,
        "how long a rank waits on a live peer (a collective, a receive) before "
        "CommTimeoutError; as torch.distributed's default", "communication"),
    Var("PLAIT_HEARTBEAT_TIMEOUT", "seconds", 8.0,
        "the silence after which a peer counts as dead (PeerFailureError)", "communication"),
    Var("PLAIT_INIT_TIMEOUT", "seconds", 300.0,
        "how long start-up waits for every rank (rendezvous, the store, parameter servers)",
        "communication"),
    Var("PLAIT_ELASTIC_MAX", "int", None,
        "N: an elastic job admits joiners only while it has fewer than N members (the others "
        "wait registered until there is room); plait train --max-workers sets it",
        "communication", low=1),
    Var("PLAIT_CHECK", "flag", True,
        "check that every rank called the same collective with matching arguments (set it "
        "alike on every rank; 0 saves one small message round per call)", "communication"),
    Var("PLAIT_DEVICE", "text", "auto",
        "the device of a job's ranks: auto (cuda:LOCAL_RANK where a GPU is visible, else cpu), "
        "cpu or cuda; `plait train --device` sets it", "devices", choices=("auto", "cpu", "cuda")),
    Var("PLAIT_SHARE_GPU", "flag", False,
        "let several local ranks share a GPU when a host has more ranks than GPUs (rank i uses "
        "cuda:i mod GPUs); without it that is an error", "devices"),
    Var("PLAIT_CUDA_TRANSPORT", "text", "auto",
        "how CUDA tensors travel: auto (NCCL where usable, else staged), nccl, or staged "
        "(through pinned host memory over plait's engine and gloo; benchmarks compare them)",
        "devices", choices=("auto", "nccl", "staged")),
    Var("PLAIT_SHM", "flag", True,
        "use shared memory between ranks of one host (collectives and large messages)",
        "communication"),
    Var("PLAIT_UNIX_SOCKETS", "flag", True,
        "connect ranks of one host through Unix sockets instead of TCP", "communication"),
    Var("PLAIT_IFADDR", "text", None,
        "the address this host's ranks listen on (default: loopback for a one-host job, "
        "else the interface that routes to MASTER_ADDR)", "communication"),
    Var("PLAIT_NODE_ID", "text", None,
        "what makes two ranks 'on the same host' (default: the hostname)", "communication"),
    Var("PLAIT_JOB_SECRET", "text", None,
        "the job's secret (32 characters or more; never printed): every connection plait "
        "accepts and every value it reads from the store proves knowledge of it. `plait run` "
        "makes one per job when unset; a multi-host job needs it (or PLAIT_JOB_SECRET_FILE)",
        "communication"),
    Var("PLAIT_JOB_SECRET_FILE", "path", None,
        "a file (mode 0600) holding the job's secret, read when PLAIT_JOB_SECRET is unset "
        "(`plait run --secret-file` sets it)", "communication"),
    Var("PLAIT_CALIBRATION", "path", None,
        "the alpha-beta calibration file of `auto` (default: "
        "$XDG_CACHE_HOME/plait/calibration.json, XDG_CACHE_HOME defaulting to ~/.cache)",
        "communication"),
    # tracing
    Var("PLAIT_TRACE", "path", None,
        "record a trace of the run (docs/tracing.md) and write it, merged over the ranks, "
        "to this Chrome trace JSON file at plait.shutdown()", "tracing"),
    # launch
    Var("PLAIT_SERVERS", "int", None,
        "how many of a job's ranks (the last ones) are parameter servers", "launch", low=0),
    Var("PLAIT_NETNS_BURST", "text", "64kb",
        "scripts/netns.sh (simulated hosts): the token-bucket burst of each rate-limited "
        "link; raise it for rates far above 1gbit (read by the shell script, not by Python)",
        "launch"),
    # plait train: set by `plait train` for its workers
    Var("PLAIT_TRAIN_EVENTS", "flag", False,
        "rank 0 reports progress as event lines for the `plait train` process (set by it)",
        "plait train (internal)"),
    Var("PLAIT_TRAIN_T0", "number", None,
        "the time.time() the job started, for wall times (set by `plait train`)",
        "plait train (internal)"),
    # test hooks
    Var("PLAIT_TRAIN_NAN_AT", "text", None,
        "STEP[:RANK]: make that rank's loss NaN at STEP (every rank's without RANK)",
        "test hooks", form=(r"\d+(:\d+)?", "STEP or STEP:RANK")),
    Var("PLAIT_TRAIN_STRAGGLER", "text", None,
        "RANK:FACTOR: make one rank FACTOR times slower at every step; transient:FACTOR: "
        "a rank drawn per step from the run's seed and the step", "test hooks",
        form=(r"(\d+|transient)(:[0-9.eE+]*)?", "RANK:FACTOR or transient:FACTOR")),
    Var("PLAIT_TRAIN_KILL_AT", "text", None,
        "RANK:N: that worker kills itself (SIGKILL): a parameter-server worker after its "
        "N-th push; under --elastic, the rank the launcher started as RANK (a parameter-"
        "server worker: worker RANK), as its backward of step N begins", "test hooks",
        form=(r"\d+:\d+", "RANK:N")),
    Var("PLAIT_TRAIN_JOIN_AT", "int", None,
        "K: under --elastic, the workers wait at step K's commit until a process asks to "
        "join, and the commits before it do not ask (a join falls at a known step); with "
        "--strategy ps they wait at the start of step K until the servers have admitted a "
        "joiner, which (given K too) asks only then: its first step is K + 1", "test hooks", low=1),
    Var("PLAIT_TRAIN_SAMPLE_LOG", "text", None,
        "FILE: under --elastic, rank 0 appends a line per committed step to FILE: the step, "
        "then its sample ids (the last line of a step counts: a step is redone after a "
        "membership change); with --strategy ps the reporting worker appends the ids whose "
        "gradients the step's round averaged", "test hooks"),
    Var("PLAIT_TRAIN_PARAMS", "text", None,
        "FILE: under --elastic --strategy ps, the reporting worker saves the final "
        "parameters (the model's state_dict, after the last round) to FILE", "test hooks"),
    Var("PLAIT_TEST_LINK", "text", None,
        "group or staged: run plait's algorithms on CPU tensors over the links CUDA tensors "
        "use (point-to-point on the gloo group, or staged copies over the engine), so CPU "
        "tests check them; read when a communicator is made", "test hooks",
        choices=("group", "staged")),
    Var("PLAIT_TRAIN_STOP_AFTER", "int", None,
        "end `plait train` after step K as if it were killed there", "test hooks", low=1),
    Var("PLAIT_TEST_MESH_DELAY", "text", None,
        "RANK:SECONDS: that rank waits before joining the engine's mesh, so the others' "
        "listeners stay open (tests of strangers at the door)", "test hooks",
        form=(r"\d+:[0-9.]+", "RANK:SECONDS")),
    Var("PLAIT_DISCOVERY_PERIOD", "seconds", 1.0,
        "seconds from the end of one run of `plait run --host-discovery-script` to the next "
        "(Horovod's period is 1 s)", "test hooks"),
    Var("PLAIT_INFER_DIE", "text", None,
        "RANK:BATCHES: a `plait infer` worker kills itself (SIGKILL) after that many batches, "
        "in the job's first attempt only", "test hooks", form=(r"\d+:\d+", "RANK:BATCHES")),
)  # fmt: skip

REGISTRY: dict[str, Var] = {v.name: v for v in VARIABLES}


def get(name: str) -> Any:
    """The value of variable `name` (parsed), or its default when unset or empty.

    Raises:
        KeyError: `name` is not in the registry (add it to VARIABLES first).
        ValueError: the variable holds text its kind cannot parse.
    """
    var = REGISTRY[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return var.default
    return var.parse(raw)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError for the first variable of the registry set to a value it does not
    accept (`environ`: os.environ), naming it, what it accepts and what it holds."""
    environ = os.environ if environ is None else environ
    for var in VARIABLES:
        raw = environ.get(var.name, "")
        if raw != "":
            var.parse(raw)


def markdown() -> str:
    """The docs page: every variable, by group."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `src/plait/env.py` (`python -m plait.env > docs/environment.md`); "
        "edit the table there.",
        "Unset or empty means the default. `plait train`, `plait run`, `plait infer` and "
        "`plait bench` check every variable before any worker starts: a value outside its "
        "column is one line and exit status 2 "
        "(`plait train: error: PLAIT_TIMEOUT must be a number of seconds; got 'abc'`).",
    ]
    groups = list(dict.fromkeys(v.group for v in VARIABLES))
    for group in groups:
        lines += ["", f"## {group[0].upper()}{group[1:]}", "",
                  "| variable | value | default | meaning |", "|---|---|---|---|"]  # fmt: skip
        for v in VARIABLES:
            if v.group == group:
                shown = "unset" if v.default is None else _shown(v)
                lines.append(f"| `{v.name}` | {v.accepts()} | {shown} | {v.meaning} |")
    return "\n".join(lines) + "\n"


def _shown(v: Var) -> str:
    if v.kind == "flag":
        return "1" if v.default else "0"
    if v.kind == "seconds":
        return f"{v.default:g} s"
    return str(v.default)


if __name__ == "__main__":
    sys.stdout.write(markdown())

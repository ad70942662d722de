"""`RunConfig`: every option of `plait run`, its default, and its checks.

The command line is derived from these fields (plait/options.py); launch/job.py starts the
job they describe. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.options import option


@dataclass(kw_only=True)
class RunConfig:
    """One `plait run`: `nproc` ranks of `script` on this host (host `node_rank` of `nnodes`)."""

    nproc: int = field(
        default=1,
        metadata=option(
            "number of processes (ranks) to start on this machine", metavar="N", aliases=("-n",)
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=option(
            "number of hosts in the job, each running its own `plait run -n N`", metavar="M"
        ),
    )
    node_rank: int = field(
        default=0, metadata=option("which host this is, in 0..M-1; host 0 runs rank 0", metavar="K")
    )
    servers: int = field(
        default=0,
        metadata=option("also start S parameter-server ranks after the N workers", metavar="S"),
    )
    keep_going_on_worker_failure: bool = field(
        default=False,
        metadata=option(
            "with --servers: a worker that fails is reported and the others go on (for "
            "asynchronous training); servers that fail still stop the job"
        ),
    )
    min_np: int | None = field(
        default=None,
        metadata=option(
            "elastic (Horovod's --min-np): a rank that fails is reported and the others go "
            "on (they re-form with plait.reform() / plait.elastic.run) while at least N "
            "live; the launcher hosts the job's store, so any rank may die",
            metavar="N",
            default_text="not elastic: a failing rank stops the job",
        ),
    )
    module: bool = field(
        default=False,
        metadata=option("SCRIPT is a module name, run like `python -m SCRIPT`", aliases=("-m",)),
    )
    master_addr: str | None = field(
        default=None,
        metadata=option(
            "rendezvous address given to every rank as MASTER_ADDR: host 0's address, "
            "reachable from every host",
            metavar="ADDR",
            default_text="127.0.0.1 with --nnodes 1; needed otherwise",
        ),
    )
    master_port: int | None = field(
        default=None,
        metadata=option(
            "rendezvous port given as MASTER_PORT, the same on every host",
            metavar="PORT",
            default_text="a free port on this machine with --nnodes 1; needed otherwise",
        ),
    )
    secret_file: str | None = field(
        default=None,
        metadata=option(
            "a file (mode 0600) holding the job's secret, the same on every host; given to "
            "the ranks as PLAIT_JOB_SECRET_FILE",
            metavar="FILE",
            default_text="PLAIT_JOB_SECRET if set, else a fresh secret per job; a job across "
            "hosts needs one or the other",
        ),
    )
    script: str = field(metadata=option("the Python script (or module, with -m)", cli=False))
    script_args: list[str] = field(default_factory=list, metadata=option(
        "arguments passed to the script unchanged", cli=False))  # fmt: skip

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"-n/--nproc must be at least 1, got {self.nproc}")
        if self.servers < 0:
            raise ConfigError(f"--servers must be at least 0, got {self.servers}")
        if self.keep_going_on_worker_failure and self.servers == 0:
            raise ConfigError(
                "--keep-going-on-worker-failure needs --servers S: without parameter servers "
                "the workers depend on each other, so one failing stops them all"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                f"got {self.node_rank}"
            )
        if self.min_np is not None and not 1 <= self.min_np <= self.nproc:
            raise ConfigError(f"--min-np must be in 1..{self.nproc} (-n), got {self.min_np}")
        if self.min_np is not None and (self.servers or self.nnodes > 1):
            raise ConfigError(
                "--min-np (elastic) is for a single host's workers: not with --servers or "
                "--nnodes yet"
            )
        if self.nnodes > 1:
            self._check_hosts()

    def _check_hosts(self) -> None:
        """What a job across hosts needs: one rendezvous every host knows; no --servers."""
        given = {"--master-addr": self.master_addr, "--master-port": self.master_port}
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs {' and '.join(missing)}: every host must be "
                "given host 0's address and the same port, e.g. "
                "--master-addr 10.0.0.1 --master-port 29500"
            )
        if self.servers:
            raise ConfigError(
                f"--servers is single-host (--nnodes {self.nnodes}); across hosts, export "
                "PLAIT_SERVERS=S on every host instead: the last S ranks of the job serve"
            )

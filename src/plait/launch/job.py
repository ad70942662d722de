"""`plait run` as a job: the command each rank runs, then the local launcher.

Everything the command line does lives here, so tests can call it; cli/run.py only parses.
"""

from __future__ import annotations

import os
import sys

from plait.errors import ConfigError
from plait.launch.config import RunConfig
from plait.launch.local import launch


def command(config: RunConfig) -> list[str]:
    """What every rank runs: `python SCRIPT ARGS` or `python -m MODULE ARGS`.

    Raises:
        ConfigError: SCRIPT is not a file (with a hint when it looks like a module name).
    """
    if config.module:
        return [sys.executable, "-m", config.script, *config.script_args]
    if not os.path.isfile(config.script):
        what = "a directory" if os.path.isdir(config.script) else "no such file"
        hint = ""
        if not config.script.endswith(".py") and os.sep not in config.script:
            hint = f"; to run a module, use `plait run -m {config.script}`"
        raise ConfigError(
            f"expected a Python script to run, got {config.script!r} ({what}, "
            f"relative to {os.getcwd()}){hint}"
        )
    return [sys.executable, config.script, *config.script_args]


def run(config: RunConfig) -> int:
    """Launch the job; return its exit status (see `plait.launch.launch`).

    Raises:
        ConfigError: the script is not there (see `command`).
    """
    env = None
    if config.secret_file is not None:
        env = dict(os.environ, PLAIT_JOB_SECRET_FILE=os.path.abspath(config.secret_file))
        env.pop("PLAIT_JOB_SECRET", None)  # the file named on the command line wins
    return launch(
        command(config),
        config.nproc,
        env=env,
        master_addr="127.0.0.1" if config.master_addr is None else config.master_addr,
        master_port=config.master_port,
        servers=config.servers,
        survivable=range(config.nproc) if config.keep_going_on_worker_failure else (),
        min_alive=config.min_np,
        nnodes=config.nnodes,
        node_rank=config.node_rank,
    )

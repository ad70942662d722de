"""`plait run` as a job: the command each rank runs, then the local launcher.

Everything the command line does lives here, so tests can call it; cli/run.py only parses.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

from plait import env
from plait.errors import ConfigError
from plait.launch.config import RunConfig
from plait.launch.elastic import ELASTIC_TIMEOUT_S, ElasticOptions
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


def check_discovery_script(script: str) -> None:
    """Refuse a discovery script the shell could not run: the program it starts with is
    neither an executable file nor a command on PATH (horovodrun would fail its first run).

    Raises:
        ConfigError: saying which, and the fix.
    """
    try:
        program = shlex.split(script)[0]
    except (ValueError, IndexError):
        raise ConfigError(f"--host-discovery-script {script!r} is not a command") from None
    if os.path.isfile(program):
        if not os.access(program, os.X_OK):
            raise ConfigError(
                f"--host-discovery-script {program} is not executable: `chmod +x {program}` "
                "(it runs as a command, as under horovodrun)"
            )
    elif os.sep not in program and shutil.which(program) is not None:
        return
    else:
        raise ConfigError(
            f"--host-discovery-script: no such file or command {program!r} (relative to "
            f"{os.getcwd()})"
        )


def elastic_options(config: RunConfig) -> ElasticOptions | None:
    """What the launcher needs of an elastic job's options (None: not elastic)."""
    if not config.elastic:
        return None
    if config.host_discovery_script is not None:
        check_discovery_script(config.host_discovery_script)
    return ElasticOptions(
        script=config.host_discovery_script,
        slots_per_host=config.slots_per_host,
        max_np=config.max_np if config.host_discovery_script is not None else config.nproc,
        reset_limit=config.reset_limit,
        cooldown=config.blacklist_cooldown_range,
        timeout_s=float(config.elastic_timeout or ELASTIC_TIMEOUT_S),
        period_s=env.get("PLAIT_DISCOVERY_PERIOD"),
    )


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
        min_alive=config.least_np,
        elastic=elastic_options(config),
        nnodes=config.nnodes,
        node_rank=config.node_rank,
    )

"""`plait run -n N script.py [args...]`: run a script as N ranks on this machine (or N per host).

Each rank runs `python script.py args...` (or `python -m module args...` with `-m`) with the
torchrun environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`, ...), so `plait.init()` and `torch.distributed.init_process_group()` work
unchanged. Every output line is prefixed `[rank R]`. If a rank fails, the others are stopped
and a summary names it and how it failed (killed, exited, raised, or frozen), then prints
the traceback of each rank that raised its own error; Ctrl-C stops every rank.

Parameter-server jobs: `plait run -n W --servers S script.py` starts W workers (ranks
0..W-1, prefixed `[rank R]`) and S servers (ranks W..W+S-1, prefixed `[server i]`), with
WORLD_SIZE = W + S and PLAIT_SERVERS = S in every rank; the script calls `plait.ps.init()`,
which serves on server ranks and returns on workers. A failing server stops the job. With
--keep-going-on-worker-failure (for async and ssp training, where the servers carry on
without a dead worker) a failing worker is reported and the others go on; the job's exit
status is then 0 if every other rank exits 0.

Elastic jobs (Horovod's flags): with --min-np N the launcher hosts the job's store and a
failing rank is reported while at least N others live (they re-form: plait.elastic.run);
with --host-discovery-script SCRIPT (run every second, printing `host:slots` lines, names
of this machine only) new slots get joining ranks, up to --max-np, and the ranks of a host
that leaves are stopped; a host on which a rank failed gets no new ranks
(--blacklist-cooldown-range), and --reset-limit bounds the membership changes.

Several hosts: run one `plait run` per host with torchrun's static multi-node flags,

    plait run -n N --nnodes M --node-rank K --master-addr HOST0 --master-port 29500 script.py

on host K = 0..M-1, where HOST0 is an address of host 0 that every host can reach (rank 0
runs there and hosts the rendezvous store on that port). Host K runs global ranks
K*N..K*N+N-1: RANK = K * N + local rank, WORLD_SIZE = M * N, LOCAL_RANK, LOCAL_WORLD_SIZE
= N, GROUP_RANK = NODE_RANK = K, GROUP_WORLD_SIZE = M. With --nnodes 1 (the default) the
job is local: loopback and a free port. `torchrun` with the same flags starts the same job
(and plait reads its variables the same way); for a parameter-server job across hosts,
export PLAIT_SERVERS=S on every host (the last S of the WORLD_SIZE ranks serve) instead of
--servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from plait.errors import EXIT_BAD_INPUT, ConfigError
from plait.launch.config import RunConfig
from plait.options import add_options, given


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait run` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "run",
        help="launch a script on N local processes (N per host with --nnodes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, RunConfig)
    # the two positionals are fields kept off the derived options (a list takes the rest)
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(RunConfig)}
    # optional to argparse, so that a missing program is our message, not "SCRIPT, ARGS"
    p.add_argument("script", metavar="SCRIPT", nargs="?", help=helps["script"])
    p.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help=helps["script_args"]
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    """Launch the job and return its exit status (2 on bad input)."""
    from plait.launch import job

    if args.script is None:
        args.parser.error(
            "what program should every rank run? give a script and its arguments, "
            "`plait run -n 2 train.py --epochs 3`, or a module with -m, `plait run -n 2 -m "
            "plait train`"
        )
    try:
        config = RunConfig(
            **given(args, RunConfig), script=args.script, script_args=args.script_args
        )
        return job.run(config)
    except ConfigError as e:
        print(f"plait run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

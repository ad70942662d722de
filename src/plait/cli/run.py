"""`plait run -n N script.py [args...]`: run a script as N ranks on this machine (or N per host).

Each rank runs `python script.py args...` (or `python -m module args...` with `-m`) with the
torchrun environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`, ...), so `plait.init()` and `torch.distributed.init_process_group()` work
unchanged. Every output line is prefixed `[rank R]`. If a rank fails, the others are stopped
and its traceback is printed last; Ctrl-C stops every rank.

Parameter-server jobs: `plait run -n W --servers S script.py` starts W workers (ranks
0..W-1, prefixed `[rank R]`) and S servers (ranks W..W+S-1, prefixed `[server i]`), with
WORLD_SIZE = W + S and PLAIT_SERVERS = S in every rank; the script calls `plait.ps.init()`,
which serves on server ranks and returns on workers. A failing server stops the job. With
--keep-going-on-worker-failure (for async and ssp training, where the servers carry on
without a dead worker) a failing worker is reported and the others go on; the job's exit
status is then 0 if every other rank exits 0.

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
import os
import sys

from plait.launch import launch


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait run` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "run",
        help="launch a script on N local processes (N per host with --nnodes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n",
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="number of processes (ranks) to start on this machine (default: 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="M",
        help="number of hosts in the job, each running its own `plait run -n N` (default: 1)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="K",
        help="which host this is, in 0..M-1; host 0 runs rank 0 (default: 0)",
    )
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        metavar="S",
        help="also start S parameter-server ranks after the N workers (default: 0)",
    )
    p.add_argument(
        "--keep-going-on-worker-failure",
        action="store_true",
        help="with --servers: a worker that fails is reported and the others go on "
        "(for asynchronous training); servers that fail still stop the job",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run like `python -m SCRIPT`",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="rendezvous address given to every rank as MASTER_ADDR: host 0's address, "
        "reachable from every host (default with --nnodes 1: 127.0.0.1; needed otherwise)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port given as MASTER_PORT, the same on every host (default with "
        "--nnodes 1: a free port on this machine; needed otherwise)",
    )
    p.add_argument("script", metavar="SCRIPT", help="the Python script (or module, with -m)")
    p.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments passed to the script unchanged",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate the arguments, launch the job, and return its exit status (2 on bad input)."""
    if args.nproc < 1:
        return _usage_error(f"-n/--nproc must be at least 1, got {args.nproc}")
    if args.servers < 0:
        return _usage_error(f"--servers must be at least 0, got {args.servers}")
    if args.keep_going_on_worker_failure and args.servers == 0:
        return _usage_error(
            "--keep-going-on-worker-failure needs --servers S: without parameter servers "
            "the workers depend on each other, so one failing stops them all"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return _usage_error(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.nnodes < 1:
        return _usage_error(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        return _usage_error(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), "
            f"got {args.node_rank}"
        )
    if args.nnodes > 1:
        missing = [
            flag
            for flag, value in (
                ("--master-addr", args.master_addr),
                ("--master-port", args.master_port),
            )
            if value is None
        ]
        if missing:
            return _usage_error(
                f"--nnodes {args.nnodes} needs {' and '.join(missing)}: every host must be "
                "given host 0's address and the same port, e.g. "
                "--master-addr 10.0.0.1 --master-port 29500"
            )
        if args.servers:
            return _usage_error(
                f"--servers is single-host (--nnodes {args.nnodes}); across hosts, export "
                "PLAIT_SERVERS=S on every host instead: the last S ranks of the job serve"
            )
    if args.module:
        cmd = [sys.executable, "-m", args.script, *args.script_args]
    elif not os.path.isfile(args.script):
        what = "a directory" if os.path.isdir(args.script) else "no such file"
        hint = ""
        if not args.script.endswith(".py") and os.sep not in args.script:
            hint = f"; to run a module, use `plait run -m {args.script}`"
        return _usage_error(
            f"expected a Python script to run, got {args.script!r} ({what}, "
            f"relative to {os.getcwd()}){hint}"
        )
    else:
        cmd = [sys.executable, args.script, *args.script_args]
    return launch(
        cmd,
        args.nproc,
        master_addr="127.0.0.1" if args.master_addr is None else args.master_addr,
        master_port=args.master_port,
        servers=args.servers,
        survivable=range(args.nproc) if args.keep_going_on_worker_failure else (),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
    )


def _usage_error(message: str) -> int:
    print(f"plait run: error: {message}", file=sys.stderr)
    return 2

"""`python -m plait.ps`: restart a killed parameter server of a running job.

Run it with the same RANK/WORLD_SIZE/MASTER_* environment the server had. It reads the
job's config from the store, restores its shard from the checkpoint, binds the same
host:port, and serves on; the workers notice the new incarnation and resend what is
unanswered (see transport.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from plait import env
from plait.comm.bootstrap.rendezvous import job_key, world_from_env
from plait.comm.bootstrap.store import make_store
from plait.ps.auth import frame_limit
from plait.ps.config import STORE_CONFIG, STORE_PARAMS, PSConfig, store_server_key
from plait.ps.loop import Router, serve
from plait.ps.roles import num_servers_from
from plait.ps.server import Server


def main(argv: list[str] | None = None) -> None:
    """Replace a killed server: restore its shard and serve until the workers are done."""
    parser = argparse.ArgumentParser(prog="python -m plait.ps", description=__doc__)
    parser.add_argument("--servers", type=int, default=None, help="S (default PLAIT_SERVERS)")
    parser.add_argument("--checkpoint-dir", default=None, help="override the job's directory")
    args = parser.parse_args(argv)
    world = world_from_env()
    servers = num_servers_from(args.servers, world.size)
    workers = world.size - servers
    if world.rank < workers:
        parser.error(f"RANK={world.rank} is a worker rank (servers are ranks {workers}..)")
    store = make_store(world, timeout=env.get("PLAIT_INIT_TIMEOUT"))
    index = world.rank - workers
    host, port = store.get(store_server_key(index)).decode().rsplit(":", 1)
    cfg = PSConfig.from_json(store.get(STORE_CONFIG))
    cfg.resume = True
    if args.checkpoint_dir:
        cfg.checkpoint_dir = args.checkpoint_dir
    if not cfg.checkpoint_dir:
        parser.error("the job has no checkpoint_dir: pass --checkpoint-dir DIR")
    params_json = store.get(STORE_PARAMS)
    limit = frame_limit(cfg.slice_bytes)
    router = Router(host, int(port), key=job_key(world), index=index, max_frame_bytes=limit)
    server = Server(index, workers, servers, lambda: (cfg, params_json), address=router.endpoint)
    server.configure(cfg, params_json, time.monotonic())
    if not server.restore(fresh_workers=False):
        server.log(
            f"no checkpoint in {cfg.checkpoint_dir}: serving the initial values is "
            "impossible, exiting"
        )
        server.close()
        router.close()
        sys.exit(1)
    serve(server, router)


if __name__ == "__main__":
    main()

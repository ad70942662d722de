"""Where this process sits in the job: the torchrun environment contract, the job's key, and
the address and host it is reached by.

The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so a script started by `plait run` or by `torchrun` (one node or many) finds
its peers the same way. The store (store.py) is torch.distributed's TCPStore, hosted by rank 0
(or by torchrun's agent). Through it every rank publishes the address its engine listens on and
the host it runs on (signed with the job's key); then every rank connects to each lower rank
(connect.py), each pair proving the key to each other (handshake.py), which gives a full mesh.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from plait import env
from plait.comm.bootstrap import secret
from plait.errors import PlaitError


@dataclass(frozen=True, kw_only=True)
class WorldEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent already hosts the store at MASTER_PORT
    # joins a running elastic job (PLAIT_ELASTIC_JOIN=1): `rank` is an id past the job's
    # ranks that names the process; its rank comes with its admission (comm/membership.py)
    joiner: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"WORLD_SIZE must be >= 1; got {self.size}")
        if not self.joiner and not 0 <= self.rank < self.size:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={self.size}); got {self.rank}")


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {raw!r}") from None


def world_from_env() -> WorldEnv:
    """Read torchrun's variables; a process started without them is a world of one."""
    size = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    assert size is not None and rank is not None
    if size > 1 and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise PlaitError(
            f"WORLD_SIZE={size} but MASTER_ADDR/MASTER_PORT are not set: start the job with "
            "`plait run -n N script.py` or `torchrun --nproc-per-node N script.py`"
        )
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    joiner = os.environ.get("PLAIT_ELASTIC_JOIN") == "1"
    if joiner and not agent_store:
        raise PlaitError(
            "PLAIT_ELASTIC_JOIN=1: a process joining a running job needs the store its "
            "launcher hosts (TORCHELASTIC_USE_AGENT_STORE=true); `plait run --min-np N` starts "
            "joiners so"
        )
    return WorldEnv(
        rank=rank,
        size=size,
        local_rank=_int_env("LOCAL_RANK", None),
        local_size=_int_env("LOCAL_WORLD_SIZE", None),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_env("MASTER_PORT", 0) or 0,
        agent_store=agent_store,
        joiner=joiner,
    )


def world_of_torch(rank: int, size: int, store_host: str | None) -> WorldEnv:
    """Where this process sits in a job torch.distributed started: torch's rank and size,
    whatever its init_method (env://, tcp://, file://, a store passed in), the launcher's
    local variables where set; the master is MASTER_ADDR, else the host of torch's TCPStore
    (`store_host`, tcp://), else loopback (a FileStore names no host: PLAIT_IFADDR then
    says where to listen, as gloo's GLOO_SOCKET_IFNAME does)."""
    return WorldEnv(
        rank=rank,
        size=size,
        local_rank=_int_env("LOCAL_RANK", None),
        local_size=_int_env("LOCAL_WORLD_SIZE", None),
        master_addr=os.environ.get("MASTER_ADDR") or store_host or "127.0.0.1",
        master_port=_int_env("MASTER_PORT", 0) or 0,
        agent_store=False,  # torch made the store and gave it to the backend
    )


def one_host(world: WorldEnv) -> bool:
    """Whether every rank of the job runs on this host: LOCAL_WORLD_SIZE == WORLD_SIZE where
    the launcher says, else a loopback MASTER_ADDR."""
    if world.size == 1:
        return True
    if world.local_size is not None:
        return world.local_size == world.size
    return _is_loopback(world.master_addr)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def job_key(world: WorldEnv) -> bytes:
    """The job's HMAC key (secret.py): the configured secret, else, for a one-host job, the
    user's host secret."""
    return secret.job_key(one_host(world))


def listen_host(master_addr: str) -> str:
    """The local address peers can reach us on: the interface that routes to the master.

    PLAIT_IFADDR overrides it. Never the wildcard address: we listen on one interface only.
    """
    address: str | None = env.get("PLAIT_IFADDR")
    if address:
        return address
    if _is_loopback(master_addr):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, 9))  # UDP connect sends nothing; it only picks a route
        host: str = probe.getsockname()[0]
        return host


def interface_of(address: str) -> str | None:
    """The name of the local network interface holding IPv4 `address` (None if none)."""
    import fcntl

    siocgifaddr = 0x8915  # Linux: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this one
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


def gloo_interface(master_addr: str) -> str | None:
    """The interface gloo should use: the one plait's engine listens on, unless loopback.

    Left alone, gloo binds to whatever the hostname resolves to: on many machines (and in
    every network namespace of scripts/netns.sh) 127.0.0.1, unreachable from other hosts;
    on others an address every host on the network can reach, although the job is local.
    So a local job's gloo listens on loopback ("lo"), a multi-host one's on the interface
    that routes to the master. None when GLOO_SOCKET_IFNAME is set already.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return interface_of(listen_host(master_addr))


def node_id() -> str:
    """What makes two ranks 'on the same host': PLAIT_NODE_ID, else the hostname."""
    return env.get("PLAIT_NODE_ID") or socket.gethostname()

"""The job's key-value store: making it, signing what plait keeps in it, and one barrier.

The store is torch.distributed's: a TCPStore hosted by rank 0 (or by torchrun's agent), a
HashStore for a world of one. Processes that do not share a Communicator (parameter-server
workers, which must outlive each other) meet through it.

Anyone who can reach the store's port can read and write it: TCPStore has no
authentication. So rank 0 binds the listening socket itself, on the rendezvous interface
only (loopback for a one-host job; torch's own would listen on every interface), and hands
it to TCPStore (`master_listen_fd`, as torchrun's agent does). Owning it is also what lets
`plait.shutdown()` free the port: torch 2.13 keeps its store alive after
destroy_process_group once torch._dynamo is imported (building an optimizer does it), and
then a second `plait.init()` on the same port would find it taken.

And every value plait writes is signed (`JobStore`): an HMAC under the job's key over the
key and the value (secret.py), checked on every read. A value someone else wrote (an
endpoint sending workers to a server of theirs, another job's address) is refused, said
once, and waited past: if the rank that owns the key writes it after, the job goes on.
Counters (`add`) are not signed: they pace barriers and carry no addresses.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from plait.comm.bootstrap import rendezvous, secret
from plait.comm.bootstrap.rendezvous import WorldEnv
from plait.errors import PlaitError

POLL_S = 0.02  # between looks at the counter: far below a step, far above a store round trip
_SIG_HEX = 2 * secret.MAC_BYTES  # a signed value: the MAC in hex, a space, the value
_GENERATION = "plait/generation"  # rank 0's fresh token for each store it hosts
_generation: bytes | None = None  # the generation of this process's last store


class ForgedValueError(PlaitError):
    """The store holds a value for a key of plait's that this job did not sign."""


class JobStore:
    """The job's store with plait's values signed; `raw` is torch's store (for gloo/NCCL).

    get/set sign and check; add/check/delete_key pass through. `close()` frees the port
    (rank 0).
    """

    def __init__(
        self,
        raw: dist.Store,
        key: bytes,
        *,
        timeout_s: float,
        listener: socket.socket | None = None,
        rank: int = 0,
    ) -> None:
        self.raw = raw
        self.key = key
        self.timeout_s = timeout_s
        self.listener = listener
        self.rank = rank
        self._refused: set[str] = set()  # keys whose forged value was already reported

    def sign(self, key: str, value: bytes) -> bytes:
        return secret.mac(self.key, "store", key, value).hex().encode() + b" " + value

    def unsigned(self, key: str, stored: bytes) -> bytes | None:
        """The value inside `stored`, or None if this job did not sign it for `key`."""
        if len(stored) <= _SIG_HEX or stored[_SIG_HEX : _SIG_HEX + 1] != b" ":
            return None
        try:
            got = bytes.fromhex(stored[:_SIG_HEX].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        value = stored[_SIG_HEX + 1 :]
        return value if secret.same(got, secret.mac(self.key, "store", key, value)) else None

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.raw.set(key, self.sign(key, data))  # type: ignore[arg-type]  # bytes are fine

    def get(self, key: str) -> bytes:
        """The signed value of `key`, waiting (as torch's get does) until there is one.

        Raises:
            ForgedValueError: only unsigned values were found within the store's timeout.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = self.unsigned(key, self.raw.get(key))
            if value is not None:
                return value
            if key not in self._refused:
                self._refused.add(key)
                print(
                    f"plait: rank {self.rank} refused the store's value for {key!r}: it is not "
                    "signed with this job's secret (written by another process, or left by "
                    "another job); waiting for a signed one",
                    file=sys.stderr,
                    flush=True,
                )
            if time.monotonic() > deadline:
                raise ForgedValueError(
                    f"the store's value for {key!r} is not signed with this job's secret, and "
                    f"no signed one came within {self.timeout_s:.0f} s: another process wrote "
                    "it (someone who can reach the store's port), or the ranks hold different "
                    "secrets (check PLAIT_JOB_SECRET / PLAIT_JOB_SECRET_FILE on every host)"
                )
            time.sleep(POLL_S * 5)

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(key))

    def close(self) -> None:
        """Stop listening (rank 0): the port is free again even if torch keeps its store.

        shutdown() acts on the socket that torch's copy of the descriptor shares, so the
        kernel drops the listening state; torch's server loop then sees no new clients.
        """
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(OSError):  # not listening any more: nothing to stop
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()


def make_store(world: WorldEnv, timeout: float) -> JobStore:
    """The job's store (a HashStore for a world of one); `timeout` (seconds) bounds its
    start-up waits (PLAIT_INIT_TIMEOUT) and a signed value's.

    Raises:
        SecretError: no job secret for a job across hosts (secret.py says how to set one).
        PlaitError: rank 0 cannot listen on the rendezvous address and port.
    """
    global _generation
    key = rendezvous.job_key(world)
    if world.size == 1:
        return JobStore(dist.HashStore(), key, timeout_s=timeout)
    host = world.rank == 0 and not world.agent_store
    listener = (
        _listen(rendezvous.listen_host(world.master_addr), world.master_port) if host else None
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            raw = dist.TCPStore(
                world.master_addr,
                world.master_port,
                world.size,
                is_master=host,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
                # torch takes ownership of the copy; ours stays to stop listening at close()
                master_listen_fd=os.dup(listener.fileno()) if listener is not None else None,
            )
            if world.agent_store:
                # torchrun's agent keeps its store across the restarts of --max-restarts:
                # each attempt's keys (plait's addresses, gloo's) under a prefix of its own,
                # or the next attempt's ranks would dial the last one's dead ports
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                prefixed = dist.PrefixStore(f"plait/attempt_{attempt}", raw)
                return JobStore(prefixed, key, timeout_s=timeout, rank=world.rank)
            store = JobStore(raw, key, timeout_s=timeout, listener=listener, rank=world.rank)
            if host:
                store.set(_GENERATION, secrets.token_hex(8))
            # After shutdown() and init() again, rank 0's last store may still be listening
            # (it stops in rank 0's own shutdown, which may come later): a store whose
            # generation this process has seen is that one. Connect again until it is gone.
            generation = store.get(_GENERATION)
            if generation != _generation:
                _generation = generation
                return store
            if time.monotonic() > deadline:
                raise PlaitError(
                    f"rank {world.rank}: the store at {world.master_addr}:{world.master_port} is "
                    f"still the last init's after {timeout:.0f} s: rank 0 did not shut down"
                )
            del store, raw
            time.sleep(POLL_S * 5)
    except BaseException:
        if listener is not None:
            listener.close()
        raise


def host_for_ranks(master_addr: str, port: int, size: int) -> JobStore:
    """The job's store hosted by the launcher (elastic jobs, `plait run --min-np`), so that
    it outlives any rank: a TCPStore listening on the rendezvous interface only, as rank
    0's would (`_listen`); the ranks connect to it as to torchrun's agent's
    (TORCHELASTIC_USE_AGENT_STORE). The launcher signs nothing: its key is unused.
    `close()` frees the port."""
    listener = _listen(rendezvous.listen_host(master_addr), port)
    try:
        raw = dist.TCPStore(
            master_addr,
            port,
            size,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=os.dup(listener.fileno()),
        )
    except BaseException:
        listener.close()
        raise
    return JobStore(raw, b"", timeout_s=0.0, listener=listener)


def tcp_host(store: dist.Store) -> str | None:
    """The host of the TCPStore beneath torch's prefixes (init_method env:// or tcp://);
    None for another kind of store (file://)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port only (never the wildcard address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT of a last job
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        hint = (
            "another job (or a store not closed) holds it: pick another port "
            "(MASTER_PORT, --master-port)"
            if e.errno == errno.EADDRINUSE
            else "check MASTER_ADDR / PLAIT_IFADDR name an address of this host"
        )
        raise PlaitError(
            f"rank 0 cannot host the rendezvous store on {host}:{port}: {e.strerror}; {hint}"
        ) from None
    return sock


def barrier(store: Any, key: str, count: int, timeout_s: float, what: str = "processes") -> None:
    """Add this process to counter `key`, then wait until `count` processes have.

    Every participant calls it once per `key` (a key is a one-shot barrier).

    Raises:
        TimeoutError: fewer than `count` arrived within `timeout_s`; the message says how
            many did.
    """
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := int(store.add(key, 0))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {arrived} of {count} {what} reached {key!r} within {timeout_s:.0f} s"
            )
        time.sleep(POLL_S)

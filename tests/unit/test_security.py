"""The job secret, signed store values and the engine's handshake, in one process.

End-to-end abuse of a running job (strangers at every listener, forged store values,
wildcard listeners) is in tests/e2e/test_abuse.py.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.comm.bootstrap import handshake, secret
from plait.comm.bootstrap.store import ForgedValueError, JobStore
from plait.errors import PlaitError
from plait.launch.env import with_secret

SECRET = "f" * 64
KEY = secret.key_from(SECRET, None, one_host=False)
OTHER = secret.key_from("0" * 64, None, one_host=False)


# -- where the secret comes from ------------------------------------------------------------
def test_key_from_text_file_and_host() -> None:
    assert len(KEY) == 32 and secret.key_from(SECRET + "\n", None, one_host=False) == KEY
    assert KEY != OTHER
    with pytest.raises(secret.SecretError, match="has 5 characters; expected at least 32") as e:
        secret.key_from("short", None, one_host=True)
    assert "short" not in str(e.value)  # not even a bad secret is printed
    with pytest.raises(secret.SecretError, match=r"spans several hosts .* PLAIT_JOB_SECRET=") as e:
        secret.key_from(None, None, one_host=False)
    assert "secrets.token_hex(32)" in str(e.value)


def test_secret_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(
        secret.SecretError, match=r"readable by other users \(mode 0644\).*chmod 600"
    ):
        secret.key_from(None, str(path), one_host=False)
    path.chmod(0o600)
    assert secret.key_from(None, str(path), one_host=False) == KEY
    with pytest.raises(secret.SecretError, match="cannot read the job secret"):
        secret.key_from(None, str(tmp_path / "missing"), one_host=False)


def test_host_secret_is_private_and_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    got: list[str] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            got.append(secret.host_secret())
        except BaseException as e:  # a thread's exception would only be a warning
            failed.append(e)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed
    assert len(got) == 8 and len(set(got)) == 1 and len(got[0]) == 64  # racing makers agree
    where = tmp_path / "plait"
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert stat.S_IMODE((where / "host-secret").stat().st_mode) == 0o600
    assert sorted(os.listdir(where)) == ["host-secret"]  # no files left aside
    where.chmod(0o755)
    with pytest.raises(secret.SecretError, match=r"mode 0755 .* another user could read"):
        secret.host_secret()


def test_mac_parts_are_length_prefixed() -> None:
    assert secret.mac(KEY, "x", "ab", "c") != secret.mac(KEY, "x", "a", "bc")
    assert secret.mac(KEY, "x", 1) != secret.mac(OTHER, "x", 1)
    assert len(secret.mac(KEY, "x")) == secret.MAC_BYTES


def test_launcher_makes_one_secret_per_job_and_checks_given_ones(tmp_path: Path) -> None:
    env = with_secret({}, nnodes=1)
    assert len(env["PLAIT_JOB_SECRET"]) == 64 and env != with_secret({}, nnodes=1)
    assert with_secret({"PLAIT_JOB_SECRET": SECRET}, nnodes=2)["PLAIT_JOB_SECRET"] == SECRET
    with pytest.raises(secret.SecretError, match="spans several hosts"):
        with_secret({}, nnodes=2)
    loose = tmp_path / "s"
    loose.write_text(SECRET)
    loose.chmod(0o640)
    with pytest.raises(secret.SecretError, match="readable by other users"):
        with_secret({"PLAIT_JOB_SECRET_FILE": str(loose)}, nnodes=2)


# -- signed store values --------------------------------------------------------------------
def test_store_values_are_signed_and_forgeries_refused_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    raw = dist.HashStore()
    store = JobStore(raw, KEY, timeout_s=5, rank=1)
    store.set("plait/addr/0", "127.0.0.1:5000 k")
    assert store.get("plait/addr/0") == b"127.0.0.1:5000 k"
    assert raw.get("plait/addr/0") != b"127.0.0.1:5000 k"  # stored with its MAC
    # a value signed for one key is refused under another, as is another job's
    raw.set("plait/addr/1", raw.get("plait/addr/0"))
    JobStore(raw, OTHER, timeout_s=1).set("plait/addr/2", "10.0.0.9:1 k")
    raw.set("plait/addr/3", "10.6.6.6:6666 ")  # a stranger's endpoint, unsigned
    for key in ("plait/addr/1", "plait/addr/2", "plait/addr/3"):
        # the owner writes the real value later: the reader waits past the forgery
        later = threading.Timer(0.3, store.set, args=(key, "127.0.0.1:7000 k"))
        later.start()
        assert store.get(key) == b"127.0.0.1:7000 k"
        later.join()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(
        "rank 1 refused the store's value for 'plait/addr/" in e for e in err
    )
    raw.set("plait/node/1", "h1")
    store.timeout_s = 0.3
    with pytest.raises(ForgedValueError, match=r"'plait/node/1' is not signed with this job's"):
        store.get("plait/node/1")
    assert SECRET not in capsys.readouterr().err


def test_store_close_frees_the_port_torch_would_keep() -> None:
    from plait.comm.bootstrap.rendezvous import WorldEnv
    from plait.comm.bootstrap.store import make_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    world = WorldEnv(rank=0, size=2, local_rank=0, local_size=2, master_addr="127.0.0.1",
                     master_port=port, agent_store=False)  # fmt: skip
    store = make_store(world, timeout=5)
    assert store.listener is not None and store.listener.getsockname() == ("127.0.0.1", port)
    kept = store.raw  # as torch._dynamo keeps it after destroy_process_group
    store.close()
    again = make_store(world, timeout=5)  # EADDRINUSE without close()
    again.set("k", "v")
    assert again.get("k") == b"v"
    again.close()
    del kept


# -- the engine's handshake -----------------------------------------------------------------
def _exchange(key_c: bytes, key_l: bytes) -> tuple[object, object]:
    """introduce (rank 2) against admit (rank 0) over a socket pair; what each returned or
    raised."""
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def listener() -> None:
        try:
            out["l"] = handshake.admit(b, key_l, 7, 0, 4)
        except handshake.Refused as e:
            out["l"] = e
            b.close()

    t = threading.Thread(target=listener)
    t.start()
    try:
        handshake.introduce(a, key_c, 7, 2, 0, 4)
        out["c"] = "ok"
    except PlaitError as e:
        out["c"] = e
    a.close()  # a connector that refused the listener hangs up
    t.join(5)
    b.close()
    return out["c"], out["l"]


def test_handshake_admits_the_job_and_refuses_other_keys() -> None:
    assert _exchange(KEY, KEY) == ("ok", 2)
    c, listener = _exchange(OTHER, KEY)
    assert isinstance(c, PlaitError) and "could not prove it holds this job's secret" in str(c)
    assert isinstance(listener, handshake.Refused)  # the connector hung up: no proof came
    c, listener = _exchange(KEY, OTHER)
    assert isinstance(c, PlaitError) and isinstance(listener, handshake.Refused)


def _raw_hello(sock: socket.socket, rank: int, nonce: bytes) -> bytes:
    sock.sendall(struct.pack("<8sQQ16s", b"plait\x00\x02\x00", rank, 4, nonce))
    data = b""
    while len(data) < 48 and (chunk := sock.recv(48 - len(data))):
        data += chunk
    return data[:16]  # the listener's nonce (nothing: it hung up)


def test_handshake_refuses_garbage_replays_and_bad_ranks() -> None:
    def admit_with(send: object) -> str:
        a, b = socket.socketpair()
        t = threading.Thread(target=send, args=(a,))
        t.start()
        try:
            handshake.admit(b, KEY, 7, 0, 4)
            return "admitted"
        except handshake.Refused as e:
            return str(e)
        finally:
            b.close()  # the listener hangs up on what it refused
            t.join(5)
            a.close()

    assert admit_with(lambda s: s.sendall(os.urandom(48))) == "not a plait hello"
    big = admit_with(lambda s: s.sendall(b"plait\x00\x02\x00" + os.urandom(1 << 16)))
    assert "rank" in big  # at most 48 bytes read, whatever follows
    assert "expected a rank in 1..3 of 4" in admit_with(lambda s: _raw_hello(s, 0, b"n" * 16))

    # a proof that was right for an earlier challenge is wrong for this one
    mine = b"c" * 16

    def replay(s: socket.socket) -> None:
        old = b"o" * 16  # the listener's nonce in the exchange the attacker saw
        _raw_hello(s, 2, mine)
        s.sendall(secret.mac(KEY, "engine-c", 7, 2, 0, 4, old, mine))

    assert "wrong proof" in admit_with(replay)


def test_a_silent_stranger_delays_no_peer(capsys: pytest.CaptureFixture[str]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    where = listener.getsockname()
    door = handshake.Door([listener], KEY, 7, 0, 3)
    silent = socket.create_connection(where)  # connects, says nothing
    garbage = socket.create_connection(where)
    garbage.sendall(b"GET / HTTP/1.1\r\n" * 4)

    def peer(rank: int) -> None:
        s = socket.create_connection(where)
        handshake.introduce(s, KEY, 7, rank, 0, 3)

    t0 = time.monotonic()
    threads = [threading.Thread(target=peer, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    got = door.collect({1, 2}, time.monotonic() + 5)
    assert sorted(got) == [1, 2] and time.monotonic() - t0 < 3
    for t in threads:
        t.join()
    for s in (*got.values(), silent, garbage, listener):
        s.close()
    err = capsys.readouterr().err
    # the garbage is refused once (the silent one may be logged too, when it hangs up)
    assert err.count("not a plait hello") == 1

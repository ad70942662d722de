"""The job secret: how plait's processes tell each other from strangers.

Every connection plait accepts (the engine's mesh, a parameter server's workers) and every
value plait reads back from the rendezvous store proves knowledge of one secret that only
the job's processes hold. The proof is an HMAC (RFC 2104, SHA-256) over fresh nonces, or
over the value and its key: the secret itself never travels, and it never passes through
the store, which anyone who can reach its port may read and write.

Where the secret comes from, the first that is set wins:

  1. PLAIT_JOB_SECRET, the text itself (`plait run` and `plait train` set a fresh one per
     job for their ranks when the user gave none);
  2. PLAIT_JOB_SECRET_FILE, a file only its owner can read (`plait run --secret-file`);
  3. for a job on one host only, the user's host secret: a file in a private directory
     ($XDG_RUNTIME_DIR/plait, else /tmp/plait-UID, mode 0700), made by whichever process
     needs it first. It is how `torchrun --standalone` jobs authenticate without set-up.

A job across hosts with neither 1 nor 2 refuses to start, with the command that makes one.
Whatever the source, the HMAC key is SHA-256 of the text, so any text of 32 characters or
more works (`secrets.token_hex(32)` gives 64).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import struct
import tempfile

from plait import env
from plait.errors import ConfigError

MIN_CHARS = 32  # shorter texts are refused: a secret must not be guessable
NONCE_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256, untruncated
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"
_HOST_FILE = "host-secret"
_LEN = struct.Struct("<Q")
_INT = struct.Struct("<q")


class SecretError(ConfigError):
    """No usable job secret: none is set for a multi-host job, or the one given is unsafe."""


def generate() -> str:
    """A fresh secret's text: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(32)


def nonce() -> bytes:
    """A fresh challenge: 16 random bytes, never used twice."""
    return secrets.token_bytes(NONCE_BYTES)


def configured() -> bool:
    """Whether the user (or the launcher) named the job's secret in the environment."""
    return bool(env.get("PLAIT_JOB_SECRET") or env.get("PLAIT_JOB_SECRET_FILE"))


def job_key(one_host: bool) -> bytes:
    """The job's 32-byte HMAC key, from the first source that is set (module docstring).

    `one_host`: every rank of the job runs on this host, so the user's host secret may
    stand in for a configured one.

    Raises:
        SecretError: the job spans hosts and no secret is configured, or the secret given
            is too short, its file is missing or readable by other users. The message
            says what to do; it never contains the secret.
    """
    return key_from(env.get("PLAIT_JOB_SECRET"), env.get("PLAIT_JOB_SECRET_FILE"), one_host)


def key_from(text: str | None, path: str | None, one_host: bool) -> bytes:
    """`job_key` from the given PLAIT_JOB_SECRET and PLAIT_JOB_SECRET_FILE values (a launcher
    checks its ranks' environment with it before starting them)."""
    if text:
        return _key(text, "PLAIT_JOB_SECRET")
    if path:
        return _key(_read_private(path, "PLAIT_JOB_SECRET_FILE"), f"the file {path}")
    if not one_host:
        raise SecretError(
            "this job spans several hosts and no job secret is set: every rank must hold "
            "the same one, or strangers could join the job. Make one and give it to every "
            f"host: `export PLAIT_JOB_SECRET=$({MAKE_ONE})` before `plait run` (or write it to "
            "a file only you can read and pass `plait run --secret-file FILE`)"
        )
    return _key(host_secret(), "the host secret")


def mac(key: bytes, label: str, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 under `key` of `label` and `parts`, each length-prefixed so that no two
    different lists of parts give the same input; ints are written as 8 bytes."""
    data = []
    for part in (label, *parts):
        if isinstance(part, int):
            part = _INT.pack(part)
        elif isinstance(part, str):
            part = part.encode()
        data.append(_LEN.pack(len(part)))
        data.append(part)
    # one call into OpenSSL: the same digest as update() part by part, a fifth of the time
    return hmac.digest(key, b"".join(data), "sha256")


def same(a: bytes, b: bytes) -> bool:
    """Constant-time equality of two MACs (no timing hint of how much matched)."""
    return hmac.compare_digest(a, b)


def _key(text: str, where: str) -> bytes:
    text = text.strip()
    if len(text) < MIN_CHARS:
        raise SecretError(
            f"the job secret in {where} has {len(text)} characters; expected at least "
            f"{MIN_CHARS}. Make one with `{MAKE_ONE}`"
        )
    return hashlib.sha256(text.encode()).digest()


def _read_private(path: str, what: str) -> str:
    """The text of `path`, refused when the file is missing or other users could read it."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise SecretError(f"{what}={path}: cannot read the job secret: {e.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"{what}={path} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"expected 0600: `chmod 600 {path}`"
        )
    with open(path) as f:
        return f.read()


def host_dir() -> str:
    """The user's private directory for the host secret (made 0700 when missing)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = os.path.join(runtime, "plait")
    else:
        path = os.path.join(tempfile.gettempdir(), f"plait-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    ):
        raise SecretError(
            f"{path} should be a directory only you can use (mode 0700, yours), but it is "
            f"mode {stat.S_IMODE(info.st_mode):04o} owned by uid {info.st_uid}: another user "
            "could read the host secret. Remove it, or set PLAIT_JOB_SECRET "
            f"(`export PLAIT_JOB_SECRET=$({MAKE_ONE})`)"
        )
    return path


def host_secret() -> str:
    """The user's host secret, made on first use. Several ranks may ask at once: the file
    appears whole or not at all (written aside, then hard-linked into place)."""
    path = os.path.join(host_dir(), _HOST_FILE)
    for _ in range(100):
        # once made the file is never removed, so one that exists can be read; asking
        # "exists?" only after a failed read raced with the maker that links it meanwhile
        if os.path.exists(path):
            return _read_private(path, "the host secret")
        aside = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate())
        try:
            os.link(aside, path)  # fails if another process won the race: read theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(aside)
    raise SecretError(f"could not make or read the host secret in {path}")

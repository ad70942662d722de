"""The exceptions plait raises. Every one derives from `PlaitError`."""

from __future__ import annotations

#: The exit status of a `plait` command given bad input (a ConfigError): argparse's own
#: for a usage error, so a bad value and a bad flag end alike.
EXIT_BAD_INPUT = 2


class PlaitError(Exception):
    """Base class of every error plait raises on purpose."""


class PeerFailureError(PlaitError, RuntimeError):
    """A peer rank died or stopped responding; the communicator is no longer usable.

    A RuntimeError, as torch.distributed's own backends raise theirs (DistBackendError):
    code written for gloo or NCCL catches it (so are the two below).

    Attributes:
        rank: the global rank of the peer that failed.
        reason: how the failure was seen ("connection closed", "no heartbeat for 8.0 s", ...).
    """

    def __init__(self, rank: int, reason: str, *, seen_by: int | None = None) -> None:
        self.rank = rank
        self.reason = reason
        self.seen_by = seen_by
        where = f" (seen by rank {seen_by})" if seen_by is not None else ""
        super().__init__(
            f"rank {rank} failed: {reason}{where}. The job cannot continue on this communicator; "
            "restart it (plait run stops the other ranks for you)."
        )


class FencedError(PlaitError):
    """This rank is not in an elastic job's new membership: the others went on without it
    (it was silent too long, e.g. frozen). The process must exit."""


class JoinRequested(PlaitError):
    """Processes wait to join this elastic job: raised by plait.elastic.State.commit() on
    every rank alike, at the same step boundary; plait.elastic.run re-forms the job with
    them (Horovod's HostsUpdatedInterrupt).

    Attributes:
        waiting: how many processes wait.
    """

    def __init__(self, waiting: int) -> None:
        super().__init__(f"{waiting} process(es) wait to join the job at this step boundary")
        self.waiting = waiting


class CollectiveMismatchError(PlaitError, RuntimeError):
    """Ranks called different collectives, or the same one with incompatible arguments.

    Attributes:
        calls: what each rank passed, indexed by rank in the communicator.
    """

    def __init__(self, calls: list[str], detail: str) -> None:
        self.calls = calls
        lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
        super().__init__(f"ranks disagree on the collective call ({detail}):\n{lines}")


class CommTimeoutError(PlaitError, TimeoutError, RuntimeError):
    """A live peer did not answer within the configured timeout (PLAIT_TIMEOUT)."""


class ConfigError(PlaitError, ValueError):
    """An option has a bad value; the message shows the failing check and what was given."""


class MissingExtraError(PlaitError, ImportError):
    """An optional dependency is not installed; the message gives the pip command."""


class CheckpointError(PlaitError):
    """A checkpoint cannot be written, read, or does not match this run."""

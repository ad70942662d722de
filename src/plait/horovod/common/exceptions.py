"""Horovod's exception names (horovod.common.exceptions), and how plait's errors surface
through them."""

from __future__ import annotations

from plait.errors import PlaitError


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died, ranks disagreed, a timeout): Horovod's name for it.
    hvd.elastic.run takes it as a failure: back to the last commit, then a new membership."""


class HostsUpdatedInterrupt(RuntimeError):
    """The membership is about to change at this commit (processes wait to join): raised by
    an elastic State's commit() or check_host_updates() on every rank alike; hvd.elastic.run
    re-forms the job without going back to the last commit.

    Args:
        skip_sync: Horovod's flag (True when hosts were only removed, where Horovod skips
            the state's sync); hvd.elastic.run here syncs after every change whatever it says.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


_COMBINED: dict[type[BaseException], type[BaseException]] = {}


def _init_args_only(self: BaseException, *args: object) -> None:
    BaseException.__init__(self, *args)


def as_horovod(err: BaseException) -> BaseException:
    """`err` re-typed so that `except hvd.HorovodInternalError` and `except plait.X` both catch it.

    Horovod wraps every failed collective in HorovodInternalError (a RuntimeError); plait
    raises its own types (CollectiveMismatchError, PeerFailureError, ...). Scripts written
    for either keep working: the error raised is a subclass of both.
    """
    if not isinstance(err, PlaitError) or isinstance(err, HorovodInternalError):
        return err
    base = type(err)
    cls = _COMBINED.get(base)
    if cls is None:
        # the subclass must not run the plait error's own __init__ (its signature differs);
        # the attributes (rank, calls, ...) are copied over instead
        cls = type(
            f"Horovod{base.__name__}",
            (HorovodInternalError, base),
            {"__init__": _init_args_only, "__module__": __name__},
        )
        _COMBINED[base] = cls
    wrapped = cls(*err.args)
    wrapped.__dict__.update(err.__dict__)
    wrapped.__traceback__ = err.__traceback__
    return wrapped

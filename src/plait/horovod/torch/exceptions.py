"""Horovod's exception names, and how plait's errors surface through them."""

from __future__ import annotations

from plait.errors import PlaitError


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died, ranks disagreed, a timeout): Horovod's name for it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's signal that the hosts changed; plait never raises it (no elastic mode)."""


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

"""Every plait error derives from PlaitError; CollectiveMismatchError names each rank's call."""

from __future__ import annotations

import inspect

import plait.errors
from plait import CollectiveMismatchError, PlaitError


def test_every_plait_error_derives_from_plait_error() -> None:
    classes = [c for _, c in inspect.getmembers(plait.errors, inspect.isclass)]
    errors = [c for c in classes if issubclass(c, BaseException)]
    assert len(errors) >= 4
    assert all(issubclass(c, PlaitError) for c in errors), errors
    assert issubclass(plait.CommTimeoutError, TimeoutError)
    e = CollectiveMismatchError(["allreduce(a)", "broadcast(b)"], "different collectives")
    assert e.calls == ["allreduce(a)", "broadcast(b)"]
    assert "rank 0: allreduce(a)" in str(e) and "rank 1: broadcast(b)" in str(e)

"""The error tracing raises on purpose."""

from __future__ import annotations

from plait.errors import PlaitError


class TraceError(PlaitError, ValueError):
    """A trace cannot be recorded or written where asked (the message says why)."""

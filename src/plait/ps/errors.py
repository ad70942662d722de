"""The parameter server's own error type (worker-visible failures that are not a dead peer)."""

from __future__ import annotations

from plait.errors import PlaitError


class PSError(PlaitError):
    """A parameter-server request failed: a bad config, mismatched parameters, a rejected
    message, or an unreachable server. The message says what was expected and what was given."""


class JobOverError(PSError):
    """A joiner came too late: every worker of the job had said goodbye or died, so the
    round it waited for could never close (PSConfig(elastic_workers=True))."""

"""Process launching: N local ranks (one host's share of a multi-host job) with the torchrun
environment, prefixed logs, teardown."""

from __future__ import annotations

from plait.launch.env import rank_env
from plait.launch.local import describe_exit, exit_status, launch
from plait.launch.ports import free_port

__all__ = ["describe_exit", "exit_status", "free_port", "launch", "rank_env"]

"""The heartbeat, delays and deadlines the failure tests share."""

from __future__ import annotations

FAST = {"PLAIT_HEARTBEAT_TIMEOUT": "2"}


DYING_DELAY = 1.0  # the dying rank waits this long, so the survivors are already blocked


EXIT_S = 5.0  # survivors' processes must be gone this soon after the last one reported


# PLAIT_CHECK=0 drops the call-matching exchange that starts every collective (it would
# catch the failure first); the survivors then wait inside the algorithm itself
IN_ALGORITHM = {**FAST, "PLAIT_CHECK": "0"}

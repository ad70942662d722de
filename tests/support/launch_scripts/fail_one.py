"""Rank FAIL_RANK fails (`raise` or `kill`, from argv); the others sleep for 60 s.

Usage: fail_one.py MODE FAIL_RANK [ignore-term]
With `ignore-term`, the surviving ranks ignore SIGTERM (so only SIGKILL stops them).
"""

import os
import signal
import sys
import time

mode, fail_rank = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
if "ignore-term" in sys.argv[3:]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"started {rank}", flush=True)
if rank == fail_rank:
    time.sleep(0.3)  # let the others start sleeping
    print("about to fail", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError(f"boom from rank {rank}")
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)

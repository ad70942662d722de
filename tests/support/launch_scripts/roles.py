"""Print the rank's role environment; rank FAIL_RANK raises, the others sleep SLEEP_S.

Usage: roles.py [FAIL_RANK [SLEEP_S]]
"""

import os
import sys
import time

KEYS = ("RANK", "WORLD_SIZE", "PLAIT_SERVERS", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE")

rank = int(os.environ["RANK"])
fail_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS), flush=True)
if rank == fail_rank:
    time.sleep(0.3)
    raise RuntimeError(f"boom from rank {rank}")
time.sleep(sleep_s)
print(f"done {rank}", flush=True)

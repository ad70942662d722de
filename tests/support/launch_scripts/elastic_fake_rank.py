"""A rank of `plait run --host-discovery-script` in tests, without torch: prints its join
variables and whether the launcher's store answers, then waits until the discovery script
(discover_schedule.sh) has run RUNS times and exits 0. Usage: elastic_fake_rank.py COUNT
RUNS [FAILS] (COUNT: the schedule's run counter file; rank FAILS exits 3 at once)."""

import os
import socket
import sys
import time

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PLAIT_ELASTIC_JOIN", "TORCHELASTIC_USE_AGENT_STORE")

with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), 5):
    store = "up"
print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS) + f" store={store}", flush=True)
count, runs = sys.argv[1], int(sys.argv[2])
if sys.argv[3:] == [os.environ["RANK"]]:
    sys.exit(3)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        with open(count) as f:
            if int(f.read()) >= runs:
                sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.02)
sys.exit(1)

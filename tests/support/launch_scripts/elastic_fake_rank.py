"""A rank of `plait run --host-discovery-script` in tests, without torch: prints its join
variables and whether the launcher's store answers, appends its RANK to the file PROGRESS
(discover_schedule.sh follows it), then waits until PROGRESS has UNTIL lines and exits 0.
Usage: elastic_fake_rank.py PROGRESS UNTIL [FAILS] (rank FAILS exits 3 at once)."""

import os
import socket
import sys
import time

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PLAIT_ELASTIC_JOIN", "TORCHELASTIC_USE_AGENT_STORE")

with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), 5):
    store = "up"
print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS) + f" store={store}", flush=True)
progress, until = sys.argv[1], int(sys.argv[2])
if sys.argv[3:] == [os.environ["RANK"]]:
    sys.exit(3)
with open(progress, "a") as f:  # one short append: whole lines from concurrent ranks
    f.write(os.environ["RANK"] + "\n")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with open(progress) as f:
        if len(f.readlines()) >= until:
            sys.exit(0)
    time.sleep(0.02)
sys.exit(1)

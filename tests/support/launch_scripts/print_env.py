"""Print the rank environment and the arguments, then a line without its newline."""

import os
import sys

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONUNBUFFERED",
)

print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in KEYS))
print("args " + repr(sys.argv[1:]))
print(f"to-stderr {os.environ['RANK']}", file=sys.stderr)
sys.stdout.write(f"partial-{os.environ['RANK']}")

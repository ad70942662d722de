"""Spawn a sleeping grandchild, append both pids to the file argv[1], then sleep for 60 s."""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n{child.pid}\n")
print("ready", flush=True)
time.sleep(60)

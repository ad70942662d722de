"""Many short jobs on the "plait" torch backend, each ending with the interpreter's own exit
(atexit, finalization: what a forked test world never does), half of them without
destroy_process_group. Prints one line per job that did not exit with status 0; the last
line is "jobs=N bad=K".

The driver imports torch and plait once, then forks each job's ranks (no thread is started
before a fork: the children make their process groups).
"""

import os
import socket
import sys

import torch
import torch._dynamo  # DDP's constructor imports it: once here, not in every job
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import plait  # noqa: F401 - registers the backend before the forks

JOBS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SIZE = 2


def job(rank: int, port: int, destroy: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(SIZE)
    )
    torch.set_num_threads(1)
    dist.init_process_group("plait")
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()  # a future left pending
    del fut
    if destroy:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


bad = 0
for i in range(JOBS):
    port = free_port()
    pids = []
    for rank in range(SIZE):
        pid = os.fork()
        if pid == 0:
            job(rank, port, destroy=i % 2 == 0)
            sys.exit(0)  # up through the driver's frames: the interpreter's own exit
        pids.append(pid)
    for rank, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
            bad += 1
            how = (
                f"signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit {os.WEXITSTATUS(status)}"
            )
            print(f"job {i} rank {rank}: {how}", flush=True)
print(f"jobs={JOBS} bad={bad}", flush=True)

"""Ranks allreduce in a loop; rank FAIL_RANK freezes itself (`stop`: SIGSTOP) or raises
ValueError (`raise`) at the third step, from argv: freeze_or_raise.py MODE FAIL_RANK."""

import os
import signal
import sys

import torch

import plait

mode, fail_rank = sys.argv[1], int(sys.argv[2])
comm = plait.init()
for step in range(1000):
    if step == 3 and comm.rank == fail_rank:
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive to the launcher, silent to peers
        raise ValueError(f"boom at step {step}")
    comm.allreduce(torch.ones(3))

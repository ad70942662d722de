"""One rank of `plait bench auth`'s init measurement (`plait run -n 4 -m
plait.bench.auth_init`): how long plait.init() takes, handshakes included."""

import time

import plait

start = time.perf_counter()
comm = plait.init()
comm.barrier()  # every rank is in: the slowest rank's init bounds everyone's
print("INIT", time.perf_counter() - start, flush=True)
plait.shutdown()

"""One rank of `plait bench auth`'s init measurement (`plait run -n 4 -m
plait.bench.auth.init_rank`): how long plait.init() takes, handshakes included."""

import time

import plait.errors  # noqa: F401  plait's package itself, off the clock (it imports no torch)


def main() -> None:
    start = time.perf_counter()
    # imported on the clock, as `plait.init()` is on first use: a rank's start includes it
    from plait.comm.world import init, shutdown

    comm = init()
    comm.barrier()  # every rank is in: the slowest rank's init bounds everyone's
    print("INIT", time.perf_counter() - start, flush=True)
    shutdown()


if __name__ == "__main__":
    main()

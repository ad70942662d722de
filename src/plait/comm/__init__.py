"""plait.comm: ranks, collectives and the transports under them. A map of the package, in
its layers from the top down; each imports only the layers below it (tests/unit/test_layers.py):

The user's surface (this folder)
    mesh.py          Mesh: a communicator's ranks on a (dp, pp, tp) grid
    world.py         plait.init() / plait.shutdown(): the default communicator
    communicator.py  Communicator: every collective in its forms (x, x_, x_async, x_async_),
                     the return conventions in one table, point-to-point, split
    messaging.py     point-to-point messages and the object collectives
    split.py         sub-communicators by ranks or colour
    reductions.py    allreduce, broadcast, reduce: argument checks, then the call
    gathers.py       allgather, reduce_scatter, alltoall, gather, scatter, barrier
    arguments.py     checks of tensors and roots, before anything is sent

dispatch/  running a call
    runner.py        call order, the hand-off to the call thread, each call's CallContext
                     (streams, shared memory, the gloo and NCCL groups)
    call_thread.py   the one thread that runs a communicator's async calls, in order
    agreement.py     the cross-rank check that every rank made the same call
    routes.py        the routing table (collective, algorithm) -> row, joined from the
                     algorithm modules; a new algorithm is one module and its rows
    auto.py          algorithm="auto": the cost model's (or a calibration's) pick
    calibration.py   the calibration file

algorithms/  every row of the routing table, each module with its rows (ROUTES), the rows
           that run on a GPU (ON_DEVICE) and its cost formulas (COSTS)
    ring, halving_doubling, tree (schedules over a Channel), direct (gather, scatter,
    alltoall, barrier), shm (through a host's shared memory), hierarchical (two levels
    across hosts), native (torch.distributed's own); context.py: the Protocol rows are
    written against; model.py: the alpha-beta parameters

backends/  torch.distributed and CUDA
    process_groups.py, cuda.py (NCCL groups, staging, stream hand-off), device_links.py

transport/  moving bytes, knowing no collective
    engine.py        tagged messages between ranks, with deadlines and failure detection;
                     with connections.py, conn.py, liveness.py, pipe_lane.py, inbound.py,
                     matching.py, wire.py
    shm_pipe.py      large messages between ranks of a host through shared memory
    arena.py         the shared-memory segment of the collectives; shared_memory.py
    watchdog.py      waiting for gloo's and NCCL's work under the failure detector

bootstrap/  starting the job (beside transport/)
    secret.py, handshake.py, rendezvous.py (the torchrun environment contract), store.py,
    connect.py (the engine's mesh of sockets)

core/  the words every layer uses
    request.py (Request), channel.py (Channel, Link), topology.py, ops.py, dtypes.py

Nothing here is imported by this file: `plait run` starts without torch.
"""

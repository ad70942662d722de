"""plait.comm: ranks, collectives and the transports under them. A map of the package:

The user's surface
    communicator.py  Communicator: every collective in its forms (x, x_, x_async, x_async_),
                     the return conventions in one table, point-to-point, split
    request.py       Request: what every async call returns
    mesh.py          Mesh: a communicator's ranks on a (dp, pp, tp) grid
    world.py         plait.init() / plait.shutdown(): the default communicator

Running a collective
    reductions.py    allreduce, broadcast, reduce: argument checks, then the call
    gathers.py       allgather, reduce_scatter, alltoall, gather, scatter, barrier
    messaging.py     point-to-point messages and the object collectives
    arguments.py     checks of tensors and roots, before anything is sent
    agreement.py     the cross-rank check that every rank made the same call
    runner.py        call order, the worker hand-off, each call's Context (streams, shared
                     memory, the gloo group)
    worker.py        the one thread that runs async collectives, in order
    split.py         sub-communicators by ranks or colour

Choosing an algorithm
    routes.py        the routing table (collective, algorithm) -> function, filled by the
                     algorithm modules; a new algorithm is one module and its rows
    select.py        algorithm="auto": the alpha-beta cost model and its calibration
    topology.py      hosts, node and local ranks, the two levels across hosts

Algorithms (each lists its rows in `ROUTES`)
    algorithms/      ring, halving_doubling, tree, hierarchical (schedules over a Channel),
                     direct (gather, scatter, alltoall, barrier)
    shm.py           collectives through shared memory on one host
    native.py        gloo's collectives, under the engine's watchdog
    ops.py           reduction operators
    p2p.py           Channel: the point-to-point interface algorithms are written against

Transport and start-up
    engine.py        tagged messages between ranks, with deadlines and failure detection;
                     with conn.py, links.py, inbound.py, matching.py, liveness.py, wire.py
    shm_pipe.py, pipe_lane.py  large messages between ranks of a host through shared memory
    dtypes.py        the dtypes carried between ranks
    rendezvous.py    the torchrun environment contract and the TCP mesh
    store.py         the job's key-value store and its barrier

Nothing here is imported by this file: `plait run` starts without torch.
"""

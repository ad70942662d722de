"""Moving bytes between ranks: the socket engine, shared memory, and the watchdog over
torch.distributed's work. Nothing here knows a collective.

The engine is one object built from a chain of classes, one per file (connections.py lists
them): Connections -> Liveness -> PipeLane -> Inbound -> Engine.

    wire.py           the frame layout
    matching.py       the Matcher of posted receives and unexpected messages (pure)
    conn.py           one peer's connection state
    connections.py    the engine's connections and frame writing
    liveness.py       heartbeats, accusing a peer, spreading the failure
    pipe_lane.py      large messages to a peer on this host through a shared-memory pipe
    inbound.py        reading, parsing and matching arriving messages
    engine.py         Engine: posting sends and receives, driving progress, closing
    shared_memory.py  whether shared memory may be used here (SHM_DIR, allowed), ShmError
    shm_pipe.py       one-way shared-memory pipes between two ranks of a host
    arena.py          Arena: a segment shared by a host's ranks, slots and counters
    watchdog.py       waiting for gloo's and NCCL's work under the engine's failure detector
"""

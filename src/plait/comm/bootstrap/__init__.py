"""Starting a job's communication: who the ranks are, the job's key, the store, and the
engine's mesh of sockets. Beside transport/, neither importing the other: world.py hands
the sockets made here to the engine.

    secret.py      the job secret (PLAIT_JOB_SECRET, a file, or the user's host secret) as an
                   HMAC key
    handshake.py   the mesh's mutual challenge-response; the `Door` that admits each
                   connection on its own thread
    rendezvous.py  the torchrun environment contract, the job's key, this rank's address
                   and host
    store.py       the job's key-value store: made on the rendezvous interface, plait's
                   values signed (`JobStore`), the one store barrier
    connect.py     the engine's full mesh: one socket to every other rank (TCP across
                   hosts, Unix sockets within one), each admitted by the handshake
"""

"""plait: distributed deep-learning training for PyTorch.

import plait
comm = plait.init()                   # rank, size, collectives (see Communicator)
total = comm.allreduce(tensor)        # sum over every rank
"""

from plait.comm.communicator import Communicator
from plait.comm.handle import Handle
from plait.comm.world import default, init, is_initialized, shutdown
from plait.errors import CollectiveMismatchError, CommTimeoutError, PeerFailureError, PlaitError

__all__ = [
    "CollectiveMismatchError",
    "CommTimeoutError",
    "Communicator",
    "Handle",
    "PeerFailureError",
    "PlaitError",
    "default",
    "init",
    "is_initialized",
    "shutdown",
]
__version__ = "0.1.0"

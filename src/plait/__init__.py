"""plait: distributed deep-learning training for PyTorch.

    import plait
    comm = plait.init()                   # rank, size, collectives (see Communicator)
    total = comm.allreduce(tensor)        # sum over every rank

Names that need torch are imported on first use, so `plait run` starts in a blink.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from plait.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    FencedError,
    JoinRequested,
    PeerFailureError,
    PlaitError,
)
from plait.lazy import getattr_from

if TYPE_CHECKING:
    from plait.activations import checkpoint_blocks
    from plait.comm.communicator import Communicator
    from plait.comm.core.request import Request
    from plait.comm.mesh import Mesh
    from plait.comm.world import default, init, is_initialized, reform, shutdown
    from plait.data_parallel import DataParallel
    from plait.devices import device
    from plait.optim import LAMB, LARS
    from plait.sharded import ShardedDataParallel

_LAZY = {
    "Communicator": "plait.comm.communicator",
    "DataParallel": "plait.data_parallel",
    "checkpoint_blocks": "plait.activations",
    "device": "plait.devices",
    "LAMB": "plait.optim",
    "LARS": "plait.optim",
    "Mesh": "plait.comm.mesh",
    "Request": "plait.comm.core.request",
    "ShardedDataParallel": "plait.sharded",
    "default": "plait.comm.world",
    "init": "plait.comm.world",
    "is_initialized": "plait.comm.world",
    "reform": "plait.comm.world",
    "shutdown": "plait.comm.world",
}

__all__ = [
    "LAMB",
    "LARS",
    "CollectiveMismatchError",
    "CommTimeoutError",
    "Communicator",
    "DataParallel",
    "FencedError",
    "JoinRequested",
    "Mesh",
    "PeerFailureError",
    "PlaitError",
    "Request",
    "ShardedDataParallel",
    "checkpoint_blocks",
    "default",
    "device",
    "init",
    "is_initialized",
    "reform",
    "shutdown",
]
__version__ = "0.1.0"

__getattr__ = getattr_from(__name__, _LAZY)

if "torch.distributed" in sys.modules:  # else torch's entry point registers it on import
    from plait.comm.torch_backend.registration import register as _register

    _register()

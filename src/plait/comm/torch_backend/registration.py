"""Register "plait" as a torch.distributed backend.

`import plait` does it where torch.distributed is imported already; torch's entry point
(pyproject's `torch.backends` group) does it at the end of `import torch`, so a script that
never imports plait can still `init_process_group("plait")`.
"""

from __future__ import annotations

import sys
from typing import Any

NAME = "plait"


def register() -> None:
    """Make `dist.init_process_group("plait")` work; idempotent."""
    import torch.distributed as dist

    if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
        return
    # devices must be a list: torch iterates a string's characters
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts: Any, backend_options: Any = None) -> Any:
    from plait.comm.torch_backend import creator  # the engine and its layers, on first use

    return creator.create(opts, backend_options)


def autoload() -> None:
    """torch's entry point: never raises, since a broken plait must not break `import torch`."""
    try:
        register()
    except Exception as e:
        print(f"plait: the torch backend 'plait' was not registered: {e}", file=sys.stderr)

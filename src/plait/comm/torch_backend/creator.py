"""torch's call to make a "plait" group: the job's engine for the default group, a
subgroup of it for `new_group` / DeviceMesh dimensions.

torch calls the creator on the group's members only, with the store it made for the
group, the member's rank and size, the timeout, the group's id (its name: "0" for the
default group, then "1", "2", ... or a hash, the same on every member) and the members'
global ranks (empty for the default group).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from plait.comm import split, world
from plait.comm.torch_backend.process_group import PlaitProcessGroup
from plait.comm.torch_backend.translate import seconds
from plait.errors import PlaitError

#: torch's default timeout for gloo/plait groups: left as it is, PLAIT_TIMEOUT decides.
TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)


def create(opts: Any, backend_options: Any = None) -> PlaitProcessGroup:
    """The ProcessGroup for torch (Backend.register_backend's creator, extended API)."""
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        return _default_group(opts)
    if not world.is_initialized():
        raise PlaitError(
            "a plait group needs the process's plait engine: make plait the default backend "
            "(init_process_group('plait') or backend='cpu:plait,cuda:nccl'), or call "
            "plait.init() before new_group(backend='plait')"
        )
    parent = world.default()
    if opts.group_rank != ranks.index(parent.rank) or opts.group_size != len(ranks):
        raise PlaitError(
            f"new_group: torch says rank {opts.group_rank} of {opts.group_size} in {ranks}, "
            f"but this process is plait's rank {parent.rank}"
        )
    comm = parent.subgroup(ranks, _comm_id(str(opts.group_id)))
    pg = PlaitProcessGroup(comm, on_shutdown=lambda: None, timeout=seconds(opts.timeout))
    world.on_close(pg.close)
    return pg


def _default_group(opts: Any) -> PlaitProcessGroup:
    timeout = None if opts.timeout == TORCH_DEFAULT_TIMEOUT else opts.timeout.total_seconds()
    parent = world.join_torch(opts.store, opts.group_rank, opts.group_size, timeout)
    # the torch group has a communicator of its own over the same engine: its calls keep
    # their own sequence and call thread, apart from plait.DataParallel's on the world's
    comm = parent.subgroup(range(parent.size), _comm_id(str(opts.group_id)))
    pg = PlaitProcessGroup(comm, on_shutdown=lambda: world.release("torch"))
    world.on_close(pg.close)
    if parent.recorder is not None:  # PLAIT_TRACE: the program's steps and compute too
        from plait.comm.torch_backend.observe import Observer

        world.on_close(Observer(parent.recorder).remove)
    return pg


def _comm_id(group_id: str) -> int:
    """The group's 30-bit communicator id: the same on every member (torch names groups
    alike everywhere), new in each generation of the job's engine, never the world's 1."""
    return split.comm_id(f"torch:{world.generation()}:{group_id}")

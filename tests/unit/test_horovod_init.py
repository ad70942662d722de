"""plait.horovod.torch before hvd.init(): every call says to call it, as Horovod's message does."""

from __future__ import annotations

import pytest
import torch


def test_use_before_init() -> None:
    import plait.horovod.torch as hvd

    calls = (
        hvd.size,
        hvd.rank,
        hvd.local_rank,
        hvd.cross_size,
        lambda: hvd.allreduce(torch.ones(1)),
    )
    for fn in calls:
        with pytest.raises(
            ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)."
        ):
            fn()

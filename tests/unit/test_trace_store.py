"""The parameter server's merged trace over a store, in one process: three workers as threads
on one store, one of them gone, and the rest merge without waiting for it."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from plait.ps import Role
from plait.trace import overstore
from support.chrome_trace import valid_trace


@pytest.mark.timeout(30)
def test_over_a_store_the_workers_merge_and_a_gone_one_is_not_awaited(tmp_path: Path) -> None:
    """overstore in one process: three workers as threads on one store; worker 2 is gone."""
    store, path = dist.HashStore(), tmp_path / "store.json"
    roles = [Role(r, 3, 1, store) for r in range(3)]
    roles[0].gone.add(2)  # as ParameterServerStep.finish learns it from the servers
    docs: list[Any] = [None] * 2

    def worker(role: Role) -> None:
        rec = overstore.start(role, path, rounds=4)
        assert role.recorder is rec
        with rec.span("ps", "push"):
            pass
        docs[role.rank] = overstore.finish(role, timeout_s=10)
        assert role.recorder is None  # finished: detached

    def gone_worker(role: Role) -> None:  # pings for its offset, then dies silently
        overstore.start(role, None, rounds=4)

    threads = [threading.Thread(target=worker, args=(roles[r],)) for r in range(2)]
    threads.append(threading.Thread(target=gone_worker, args=(roles[2],)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert docs[1] is None and docs[0] == json.loads(path.read_text())
    doc = docs[0]
    events = valid_trace(doc, 2, ["worker 0", "worker 1"])
    assert Counter(e["pid"] for e in events if e["name"] == "push") == {0: 1, 1: 1}
    assert doc["otherData"]["missing_ranks"] == [2]
    assert doc["otherData"]["clock"]["ranks"] == [0, 1]
    assert not store.check([f"{overstore.PREFIX}events/1"])  # read, then deleted

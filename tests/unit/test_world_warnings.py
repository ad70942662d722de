"""What plait.init() says about the host before the job runs: more torch threads than
cores across this host's ranks (large collectives then wait on each other's threads)."""

from __future__ import annotations

import pytest

from plait.comm import placement


@pytest.mark.parametrize(
    ("rank", "local", "threads", "cores", "says"),
    [
        (0, 2, 2, 2, "set OMP_NUM_THREADS=1"),
        (0, 4, 4, 8, "set OMP_NUM_THREADS=2"),
        (1, 2, 2, 2, None),  # rank 0 speaks for the host
        (0, 2, 1, 2, None),  # one thread each: nothing to say
        (0, 2, 4, 8, None),  # enough cores
        (0, 1, 8, 2, None),  # alone on its host
    ],
)
def test_oversubscribed_host_is_named_once(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rank: int,
    local: int,
    threads: int,
    cores: int,
    says: str | None,
) -> None:
    monkeypatch.setattr(placement.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(placement.os, "cpu_count", lambda: cores)
    placement.warn_oversubscribed(rank, local)
    err = capsys.readouterr().err
    assert (says in err) if says else err == "", err

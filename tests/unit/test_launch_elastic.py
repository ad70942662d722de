"""`plait run --min-np N`: the options' checks, and the launcher keeping the job going
while at least N ranks live (real processes: each a one-line Python command)."""

from __future__ import annotations

import io
import sys

import pytest

from plait.errors import ConfigError
from plait.launch.config import RunConfig
from plait.launch.local import launch

FAIL_RANK_1 = [
    sys.executable,
    "-c",
    "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)",
]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"nproc": 2, "min_np": 3}, "--min-np must be in 1..2"),
        ({"nproc": 2, "min_np": 0}, "--min-np must be in 1..2"),
        ({"nproc": 2, "min_np": 1, "servers": 1}, "not with --servers or --nnodes"),
    ],
)
def test_bad_min_np_is_refused(kwargs: dict[str, int], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        RunConfig(script="x.py", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("min_alive", "status"), [(2, 0), (3, 3)])
def test_a_failing_rank_stops_the_job_only_below_min_np(min_alive: int, status: int) -> None:
    err = io.StringIO()
    got = launch(FAIL_RANK_1, 3, min_alive=min_alive, stdout=io.StringIO(), stderr=err)
    assert got == status, err.getvalue()
    goes_on = "rank 1 failed (exit code 3); the job goes on without it"
    stops = "rank 1 failed (exit code 3); 2 rank(s) left, fewer than --min-np 3"
    assert (goes_on in err.getvalue(), stops in err.getvalue()) == (status == 0, status != 0)

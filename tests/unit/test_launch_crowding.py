"""The launcher's warning when ranks far outnumber the host's cores (launch/crowding.py)."""

from plait.launch import crowding


def test_ranks_far_beyond_the_cores_are_warned_of() -> None:
    assert crowding.warning(8, 2) is None  # 4 per core: plait train's default is 4 on 2
    line = crowding.warning(64, 2)
    assert line is not None and line.startswith("64 ranks on 2 cores (32 per core)")
    assert "8 ranks or fewer" in line and "docs/failures.md#starved-ranks" in line
    assert crowding.cores() >= 1

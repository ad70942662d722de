"""The environment `plait run` gives each rank (launch.rank_env): roles with --servers, and
ranks numbered node by node with --nnodes, with the errors of both; and an elastic job's
joiners (launch.env.join_env)."""

from __future__ import annotations

import pytest

from plait.launch import rank_env
from plait.launch.env import join_env


def test_rank_env_roles() -> None:
    env = {r: rank_env(r, 5, master_addr="h", master_port=1, base={}, servers=2) for r in range(5)}
    assert [env[r]["ROLE_NAME"] for r in range(5)] == ["worker"] * 3 + ["server"] * 2
    assert [env[r]["ROLE_RANK"] for r in range(5)] == ["0", "1", "2", "0", "1"]
    assert [env[r]["ROLE_WORLD_SIZE"] for r in range(5)] == ["3"] * 3 + ["2"] * 2
    assert all(e["PLAIT_SERVERS"] == "2" and e["WORLD_SIZE"] == "5" for e in env.values())
    plain = rank_env(1, 2, master_addr="h", master_port=1, base={})
    assert "PLAIT_SERVERS" not in plain and plain["ROLE_NAME"] == "default"
    with pytest.raises(ValueError, match="at least one worker"):
        rank_env(0, 2, master_addr="h", master_port=1, servers=2)


def test_rank_env_numbers_ranks_node_by_node() -> None:
    envs = [
        rank_env(local, 3, master_addr="10.0.0.1", master_port=29500, base={}, nnodes=2,
                 node_rank=node)
        for node in range(2)
        for local in range(3)
    ]  # fmt: skip
    assert [e["RANK"] for e in envs] == [str(r) for r in range(6)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"] * 2
    assert (
        [e["GROUP_RANK"] for e in envs] == [e["NODE_RANK"] for e in envs] == ["0"] * 3 + ["1"] * 3
    )
    for e in envs:
        assert e["WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "6"
        assert e["LOCAL_WORLD_SIZE"] == "3" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["ROLE_RANK"] == e["RANK"]
        assert e["MASTER_ADDR"] == "10.0.0.1" and e["MASTER_PORT"] == "29500"
    single = rank_env(1, 2, master_addr="h", master_port=1, base={})
    assert (
        single["RANK"] == "1" and single["GROUP_RANK"] == "0" and single["GROUP_WORLD_SIZE"] == "1"
    )
    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.1 \(nnodes=2\), got 2"):
        rank_env(0, 2, master_addr="h", master_port=1, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="export PLAIT_SERVERS=S on every node"):
        rank_env(0, 2, master_addr="h", master_port=1, nnodes=2, servers=1)


def test_a_joiner_gets_a_fresh_rank_and_the_join_flag() -> None:
    env = join_env(7, 1, 3, master_addr="h", master_port=1, base={"X": "y"})
    got = {k: env[k] for k in ("RANK", "ROLE_RANK", "LOCAL_RANK", "WORLD_SIZE", "X")}
    assert got == {"RANK": "7", "ROLE_RANK": "7", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "X": "y"}
    assert env["PLAIT_ELASTIC_JOIN"] == "1" and env["MASTER_PORT"] == "1"

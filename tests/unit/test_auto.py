"""The cost model behind algorithm="auto", the table it chooses from, and the calibration
file round trip."""

import json
import os

import pytest

from plait.bench.collectives.calibrate import fit_line
from plait.comm.algorithms import hierarchical
from plait.comm.algorithms.model import NETWORK, AlphaBeta
from plait.comm.core.topology import Topology
from plait.comm.dispatch import auto, calibration, routes
from plait.sizes import format_size, parse_size

ONE_HOST = Topology(["h0"] * 4, 0)  # with PLAIT_SHM=0 (shared memory off) the model decides
TWO_BY_TWO = Topology(["h0", "h0", "h1", "h1"], 0)  # 2 hosts x 2 ranks


def test_formulas_follow_thakur():
    params = AlphaBeta(alpha=1.0, beta=0.0, gamma=0.0)
    # latency terms only: ring 2(p-1), halving-doubling 2 lg p (+2 to fold), tree 2 lg p
    assert auto.predict("ring", 100, 8, params) == 14
    assert auto.predict("halving_doubling", 100, 8, params) == 6
    assert auto.predict("halving_doubling", 100, 6, params) == 4 + 2
    assert auto.predict("tree", 100, 8, params) == 6
    params = AlphaBeta(alpha=0.0, beta=1.0, gamma=0.0)
    # bandwidth terms: ring and HD move 2(p-1)/p n, tree 2 lg p n
    assert auto.predict("ring", 1000, 4, params) == pytest.approx(1500)
    assert auto.predict("tree", 1000, 4, params) == pytest.approx(4000)


def test_default_model_prefers_latency_for_small_and_bandwidth_for_large():
    small = min(("ring", "halving_doubling", "tree"), key=lambda a: auto.predict(a, 1024, 8))
    large = min(("ring", "halving_doubling", "tree"), key=lambda a: auto.predict(a, 1 << 28, 8))
    assert small in ("tree", "halving_doubling")  # 2 lg p latency terms, vs 2(p-1) for ring
    assert large in ("ring", "halving_doubling")  # tree moves 2 lg p * n bytes


def test_across_hosts_the_two_level_allreduce_wins_where_the_network_is_the_cost():
    # 2 hosts x 2 ranks on a 1 Gbit/s network: the host link carries n instead of 1.5 n
    assert auto.choose("allreduce", 16 << 20, TWO_BY_TWO) == "hierarchical"
    flat = auto.predict("ring", 16 << 20, 4, NETWORK)
    two_level = hierarchical.allreduce_cost(16 << 20, 2, 2, NETWORK)
    assert 1.3 < flat / two_level < 1.5


def test_fit_line_recovers_a_line():
    a, b = fit_line([(n, 5e-5 + 2e-9 * n) for n in (4096, 65536, 1 << 20, 8 << 20)])
    assert a == pytest.approx(5e-5, rel=1e-6)
    assert b == pytest.approx(2e-9, rel=1e-6)


def test_auto_uses_shared_memory_when_every_rank_shares_a_host(monkeypatch):
    for collective in ("allreduce", "broadcast", "allgather", "reduce_scatter"):
        assert auto.choose(collective, 1024, ONE_HOST) == "shm"
    assert auto.choose("allreduce", 1024, TWO_BY_TWO) != "shm"
    monkeypatch.setenv("PLAIT_SHM", "0")  # the switch that turns the transport off
    assert auto.choose("allreduce", 1024, ONE_HOST) != "shm"
    assert auto.choose("allgather", 1024, ONE_HOST) == "ring"
    # across hosts, without shared memory the two-level algorithms cannot run either
    assert "hierarchical" not in routes.usable("allreduce", TWO_BY_TWO)
    assert auto.choose("reduce_scatter", 1024, TWO_BY_TWO) == "ring"


def test_the_table_is_what_auto_chooses_from(monkeypatch):
    monkeypatch.setenv("PLAIT_SHM", "1")
    layouts = [ONE_HOST, TWO_BY_TWO, Topology(["h0", "h0", "h1"], 2), Topology(["h0"], 0)]
    for topology in layouts:
        for collective in routes.COLLECTIVES:
            usable = routes.usable(collective, topology)
            assert set(usable) <= set(routes.ACCEPTED[collective]) - {"auto"}
            for n in (4, 1 << 16, 1 << 26):
                assert auto.choose(collective, n, topology) in usable, (collective, topology)
    # where each row can run: shm on one host, hierarchical on equal hosts of > 1 rank
    assert "shm" in routes.usable("allgather", ONE_HOST)
    assert "shm" not in routes.usable("allgather", TWO_BY_TWO)
    assert "hierarchical" in routes.usable("reduce_scatter", TWO_BY_TWO)
    assert "hierarchical" not in routes.usable("reduce_scatter", Topology(["a", "a", "b"], 0))
    with pytest.raises(ValueError, match="'auto', 'native', 'tree'; got 'ring'"):
        routes.check("reduce", "ring")


def test_interpolation_is_a_local_alpha_beta_line():
    points = [[1000, 1.0], [2000, 3.0], [4000, 4.0]]
    assert calibration.interpolate(points, 1500) == pytest.approx(2.0)
    assert calibration.interpolate(points, 3000) == pytest.approx(3.5)
    assert calibration.interpolate(points, 8000) == pytest.approx(6.0)  # the last line, extended
    assert calibration.interpolate(points, 500) == pytest.approx(1e-9)  # clamped at the origin


def test_calibration_round_trip_decides_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    monkeypatch.setenv("PLAIT_SHM", "0")
    sizes = (4096, 1 << 20, 1 << 26)
    lines = {
        "native": (1e-3, 1e-10),
        "ring": (1e-4, 1e-8),
        "halving_doubling": (2e-4, 1e-8),
        "tree": (5e-5, 5e-8),
    }
    points = {a: [[n, x + y * n] for n in sizes] for a, (x, y) in lines.items()}
    calibration.save_calibration(4, 1, "allreduce", points)
    calibration.load_calibration(reload=True)
    try:
        assert auto.choose("allreduce", 1024, ONE_HOST) == "tree"
        assert auto.choose("allreduce", 1 << 26, ONE_HOST) == "native"
        saved = json.loads((tmp_path / "cal.json").read_text())
        assert saved["points"]["p4-n1"]["allreduce"]["ring"] == points["ring"]
    finally:
        monkeypatch.delenv("PLAIT_CALIBRATION")
        calibration.load_calibration(reload=True)


def test_sizes_parse_and_print():
    assert parse_size("4K") == 4096
    assert parse_size("64M") == 64 << 20
    assert format_size(parse_size("16M")) == "16M"
    with pytest.raises(ValueError, match="4K, 1M"):
        parse_size("lots")
    with pytest.raises(ValueError, match="multiple of 4"):
        parse_size("3")


def test_auto_leaves_the_baseline_only_for_a_clear_gain(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    monkeypatch.setenv("PLAIT_SHM", "0")
    sizes = (4096, 1 << 26)
    # ring 5% faster than native at every size: within the noise, so native
    lines = {"native": 1.0, "ring": 0.95, "halving_doubling": 1.2, "tree": 1.5}
    calibration.save_calibration(
        4, 1, "allreduce", {a: [[n, f * n * 1e-9] for n in sizes] for a, f in lines.items()}
    )
    calibration.load_calibration(reload=True)
    try:
        assert auto.choose("allreduce", 1 << 20, ONE_HOST) == "native"
        lines["ring"] = 0.8  # 20% faster: worth it
        calibration.save_calibration(
            4, 1, "allreduce", {a: [[n, f * n * 1e-9] for n in sizes] for a, f in lines.items()}
        )
        calibration.load_calibration(reload=True)
        assert auto.choose("allreduce", 1 << 20, ONE_HOST) == "ring"
    finally:
        monkeypatch.delenv("PLAIT_CALIBRATION")
        calibration.load_calibration(reload=True)


def test_measured_levels_decide_the_two_level_allreduce(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CALIBRATION", str(tmp_path / "cal.json"))
    try:
        # a very slow network level (1 s per call): the flat algorithms win
        calibration.save_levels(4, 2, {"local": (1e-4, 1e-10), "network": (1.0, 1e-9)})
        assert calibration.load_levels(4, 2) == {"local": [1e-4, 1e-10], "network": [1.0, 1e-9]}
        assert auto.choose("allreduce", 16 << 20, TWO_BY_TWO) != "hierarchical"
        # a fast one: the two-level algorithm
        calibration.save_levels(4, 2, {"local": (1e-4, 1e-10), "network": (1e-4, 1e-10)})
        assert auto.choose("allreduce", 16 << 20, TWO_BY_TWO) == "hierarchical"
    finally:
        monkeypatch.delenv("PLAIT_CALIBRATION")
        calibration.load_calibration(reload=True)


def test_every_rank_sees_a_calibration_another_rank_wrote(tmp_path, monkeypatch):
    # auto must choose alike on every rank: a rank that kept an old copy of the file after
    # rank 0 rewrote it (as calibration does, between two barriers) would run another
    # algorithm than its peers and wait for messages they never send
    path = tmp_path / "cal.json"
    monkeypatch.setenv("PLAIT_CALIBRATION", str(path))
    try:
        assert calibration.load_levels(4, 2) is None  # read (no file) and kept
        levels = {"local": [1e-5, 1e-10], "network": [5e-5, 8e-9]}
        key = calibration.world_key(4, 2)

        def write() -> None:  # as rank 0 does, in another process: a new file, renamed
            tmp = tmp_path / "cal.tmp"
            tmp.write_text(json.dumps({"levels": {key: levels}}))
            os.replace(tmp, path)

        write()
        assert calibration.load_levels(4, 2) == levels  # no reload asked for
        levels["network"] = [6e-5, 9e-9]  # the same size of file, within one mtime tick
        write()
        assert calibration.load_levels(4, 2) == levels
    finally:
        monkeypatch.delenv("PLAIT_CALIBRATION")
        calibration.load_calibration(reload=True)

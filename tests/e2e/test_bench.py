"""`plait bench collectives` end to end, tiny: every algorithm appears, ratios are computed."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_bench_collectives_writes_every_algorithm(tmp_path):
    out = tmp_path / "bench.json"
    env_cal = {"PLAIT_CALIBRATION": str(tmp_path / "cal.json")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "bench",
            "collectives",
            "-n",
            "2",
            "--sizes",
            "4K,64K",
            "--repeats",
            "2",
            "--budget",  # one call per timing: what is checked is the table, not the times
            "0.01",
            "--calibrate",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env={**_env(), **env_cal},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2
    assert set(data["results"]) == {"4096", "65536"}
    for cells in data["results"].values():
        assert set(cells) == {"torch", "native", "shm", "ring", "halving_doubling", "tree", "auto"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in cells.values())
    assert set(data["calibration"]) == {"native", "ring", "halving_doubling", "tree"}
    assert json.loads((tmp_path / "cal.json").read_text())["points"]["p2-n1"]["allreduce"]
    assert "vs torch" in proc.stdout and "auto (shm)" in proc.stdout  # one host: shared memory
    assert data["memcpy_GBps"] > 0 and "memory copy, one thread" in proc.stdout
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "bench",
            "collectives",
            "--from-json",
            str(out),
            "--markdown",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert again.returncode == 0, again.stderr
    lines = again.stdout.strip().splitlines()
    # the routing table's rows in its order (hierarchical needs hosts), between peer and auto
    from plait.comm.dispatch import routes

    rows = [a for a, _ in routes.ROWS["allreduce"] if a != "hierarchical"]
    assert lines[0].startswith(
        "| size | " + " | ".join(f"{a} (ms)" for a in ["torch", *rows, "auto"]) + " |"
    )
    assert len(lines) == 2 + 2 + 2 and lines[-1].startswith("memory copy")


def test_bench_rejects_bad_input():
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "collectives", "--algorithms", "ring,fastest"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "fastest" in proc.stderr and "halving_doubling" in proc.stderr


def _env():
    import os

    return dict(os.environ)


@pytest.mark.timeout(150)
def test_bench_train_compares_plait_with_ddp(tmp_path):
    out = tmp_path / "train.json"
    cmd = [
        sys.executable, "-m", "plait", "bench", "train", "--nproc", "2", "--workloads",
        "gpt,mlp", "--global-batch", "8", "--steps", "2", "--repeats", "2",
        "--json", str(out), "--markdown",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=140,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    [run] = data["runs"]
    assert run["world_size"] == 2 and set(run["workloads"]) == {"gpt", "mlp"}
    for w in run["workloads"].values():
        assert set(w["samples_per_s"]) == {"plait", "ddp"}
        assert all(len(v) == 2 and min(v) > 0 for v in w["samples_per_s"].values())
    for row in data["summary"]:
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert "plait / DDP" in proc.stdout and "| gpt | 2 |" in proc.stdout


@pytest.mark.timeout(200)
def test_bench_comm_compares_the_ways_on_this_machine(tmp_path):
    """--hosts 1 (loopback; the simulated hosts need root): every way trains, FIFO and
    priority send the gradient's bytes per step, DDP's fp16 hook half of them."""
    out = tmp_path / "comm.json"
    cmd = [
        sys.executable, "-m", "plait", "bench", "comm", "--hosts", "1", "-n", "2",
        "--workloads", "mlp", "--ways", "fifo,priority,ddp,ddp-fp16", "--steps", "2",
        "--repeats", "2", "--warmup", "1", "--json", str(out), "--markdown",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=190, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    w = data["runs"]["None"]["workloads"]["mlp"]
    assert all(len(v) == 2 and min(v) > 0 for v in w["samples_per_s"].values())
    grad = 4 * w["parameters"]
    sent = w["sent_bytes"]
    assert sent["fifo"] == sent["priority"] == sent["ddp"] == grad
    assert sent["ddp-fp16"] == grad // 2
    assert w["compute_s"] > 0
    rows = {r["way"]: r for r in data["summary"]}
    assert rows["fifo"]["vs_fifo"] == 1.0 and rows["priority"]["vs_fifo"] > 0
    assert "| None | mlp | priority |" in proc.stdout


def test_bench_train_rejects_uneven_batch():
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "train", "--nproc", "3", "--global-batch", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "--global-batch 8 % 3 ranks = 2 != 0" in proc.stderr

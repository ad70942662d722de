"""`plait bench collectives`, `train`, `comm` (also `--to-target`), `torch-backend` and
`infer` end to end, tiny: every algorithm, workload and way appears, ratios are computed,
bad input is refused (`elastic` too, whose smallest run takes a minute). The commands run
at once, once for the module: what is checked is the tables, not the times (a bench that
runs one process at a time, as `comm --to-target` on 1 rank and `infer`'s trainings do,
leaves a core to the others)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.bench.infer import runs as infer_runs
from plait.comm.dispatch import routes
from support.commands import Command, commands_at_once
from support.paths import SRC

Ran = dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def ran(folder: Path) -> Ran:
    """Each command's end, by name; their --json files are in `folder`."""
    bench = ["-m", "plait", "bench"]
    return commands_at_once(
        {
            "collectives": Command(
                [*bench, "collectives", "-n", "2", "--sizes", "4K,64K", "--repeats", "2",
                 # one call per timing: what is checked is the table, not the times
                 "--budget", "0.01", "--calibrate", "--json", str(folder / "bench.json")],
                env={"PLAIT_CALIBRATION": str(folder / "cal.json")},
            ),
            "train": Command(
                [*bench, "train", "--nproc", "2", "--workloads", "gpt,mlp", "--global-batch",
                 "8", "--steps", "2", "--repeats", "2", "--json", str(folder / "train.json"),
                 "--markdown"],
            ),
            # --hosts 1: loopback (the simulated hosts need root)
            "comm": Command(
                [*bench, "comm", "--hosts", "1", "-n", "2", "--workloads", "mlp", "--ways",
                 "fifo,priority,ddp,ddp-fp16", "--steps", "2", "--repeats", "2", "--warmup",
                 "1", "--json", str(folder / "comm.json"), "--markdown"],
            ),
            "torch-backend": Command(
                [*bench, "torch-backend", "-n", "2", "--workloads", "cnn", "--global-batch", "8",
                 "--steps", "2", "--repeats", "2", "--warmup", "1", "--calls", "20", "--json",
                 str(folder / "torch_backend.json"), "--markdown"],
            ),
            # 1 rank: what is checked is what the command runs, prints and writes, the
            # smallest job that shows it (the ways' bytes between ranks are "comm"'s); mlp
            # for 20 steps, fifo and top-k train, DDP is reported skipped
            "comm target": Command(
                [*bench, "comm", "--hosts", "1", "-n", "1", "--workloads", "mlp", "--ways",
                 "fifo,topk:0.01,ddp", "--steps", "1", "--repeats", "1", "--warmup", "1",
                 "--to-target", "--target-steps", "20", "--target-eval-every", "10", "--json",
                 str(folder / "comm_target.json"), "--markdown"],
            ),
            # mlp trained on one worker for 6 steps: what is checked is what the command
            # measures and writes, not how well the model learnt
            "infer": Command(
                [*bench, "infer", "--models", "mlp", "--steps-scale", "0.01", "--workers", "1",
                 "--calls", "10", "--repeats", "1", "--predict-repeats", "1", "--workers-list",
                 "1,2", "--runs", str(folder / "runs"), "--json", str(folder / "infer.json")],
                env={"PYTHONPATH": str(SRC), "COLUMNS": "200"},
            ),
            "torch-backend cuda": Command([*bench, "torch-backend", "--device", "cuda"]),
            "bad algorithm": Command([*bench, "collectives", "--algorithms", "ring,fastest"]),
            "uneven batch": Command([*bench, "train", "--nproc", "3", "--global-batch", "8"]),
            "elastic too few": Command([*bench, "elastic", "-n", "3"]),
        },
        timeout=190,
    )  # fmt: skip


@pytest.mark.timeout(200)
def test_bench_collectives_writes_every_algorithm(ran: Ran, folder: Path) -> None:
    proc = ran["collectives"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = folder / "bench.json"
    data = json.loads(out.read_text())
    assert data["world_size"] == 2
    assert set(data["results"]) == {"4096", "65536"}
    for cells in data["results"].values():
        assert set(cells) == {"torch", "native", "shm", "ring", "halving_doubling", "tree", "auto"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in cells.values())
    assert set(data["calibration"]) == {"native", "ring", "halving_doubling", "tree"}
    assert json.loads((folder / "cal.json").read_text())["points"]["p2-n1"]["allreduce"]
    assert "vs torch" in proc.stdout and "auto (shm)" in proc.stdout  # one host: shared memory
    assert data["memcpy_GBps"] > 0 and "memory copy, one thread" in proc.stdout
    again = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "collectives", "--from-json", str(out),
         "--markdown"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    lines = again.stdout.strip().splitlines()
    # the routing table's rows in its order (hierarchical needs hosts), between peer and auto
    rows = [a for a, _ in routes.ROWS["allreduce"] if a != "hierarchical"]
    assert lines[0].startswith(
        "| size | " + " | ".join(f"{a} (ms)" for a in ["torch", *rows, "auto"]) + " |"
    )
    assert len(lines) == 2 + 2 + 2 and lines[-1].startswith("memory copy")


@pytest.mark.timeout(200)
def test_bench_rejects_bad_input(ran: Ran) -> None:
    proc = ran["bad algorithm"]
    assert proc.returncode == 2
    assert "fastest" in proc.stderr and "halving_doubling" in proc.stderr


@pytest.mark.timeout(200)
def test_bench_train_rejects_uneven_batch(ran: Ran) -> None:
    proc = ran["uneven batch"]
    assert proc.returncode == 2
    assert "--global-batch 8 % 3 ranks = 2 != 0" in proc.stderr


@pytest.mark.timeout(200)
def test_bench_elastic_refuses_too_few_workers(ran: Ran) -> None:
    """Before starting anything (a real run takes a minute at its smallest: its figures and
    report are tested from events in tests/unit/test_bench_elastic.py)."""
    proc = ran["elastic too few"]
    assert proc.returncode == 2
    assert "-n 3: needs at least 4 workers (one is killed, one fenced" in proc.stderr


@pytest.mark.timeout(200)
def test_bench_train_compares_plait_with_ddp(ran: Ran, folder: Path) -> None:
    proc = ran["train"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((folder / "train.json").read_text())
    [run] = data["runs"]
    assert run["world_size"] == 2 and set(run["workloads"]) == {"gpt", "mlp"}
    for w in run["workloads"].values():
        assert set(w["samples_per_s"]) == {"plait", "ddp"}
        assert all(len(v) == 2 and min(v) > 0 for v in w["samples_per_s"].values())
    for row in data["summary"]:
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert "plait / DDP" in proc.stdout and "| gpt | 2 |" in proc.stdout


@pytest.mark.timeout(200)
def test_bench_comm_compares_the_ways_on_this_machine(ran: Ran, folder: Path) -> None:
    """Every way trains, FIFO and priority send the gradient's bytes per step, DDP's fp16
    hook half of them."""
    proc = ran["comm"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((folder / "comm.json").read_text())
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


@pytest.mark.timeout(200)
def test_bench_torch_backend_runs_the_same_code_on_plait_and_gloo(ran: Ran, folder: Path) -> None:
    """DDP, FSDP2 and the small all_reduce each timed on both groups every round, a row each
    with its ratio and bar."""
    proc = ran["torch-backend"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((folder / "torch_backend.json").read_text())
    [run] = data["runs"]
    assert run["world_size"] == 2 and run["peer"] == "gloo"
    cnn = run["workloads"]["cnn"]
    for measured in (run["latency"], cnn["ddp"], cnn["fsdp2"]):
        ways = measured["ways"]
        assert set(ways) == {"plait", "gloo"}
        assert all(len(w["round_s"]) == 2 and min(w["round_s"]) > 0 for w in ways.values()), ways
    # the same steps on the same batches: at 2 ranks a sum has one order, so equal bits
    assert cnn["ddp"]["max_param_diff"] == cnn["fsdp2"]["max_param_diff"] == 0.0
    rows = {(r["workload"], r["measure"]): r for r in data["summary"]}
    assert list(rows) == [("all_reduce 16 B", "latency"), ("cnn", "ddp"), ("cnn", "fsdp2")]
    for r in rows.values():
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and "failed" not in r
        assert r["met"] == (r["ratio"] >= {"latency": 2.0, "ddp": 1.2, "fsdp2": 1.5}[r["measure"]])
    assert "| 2 | cnn | FSDP2 step |" in proc.stdout and "bars (issue 32) met:" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
@pytest.mark.timeout(200)
def test_bench_torch_backend_on_cuda_without_a_gpu_says_so(ran: Ran) -> None:
    proc = ran["torch-backend cuda"]
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("plait bench torch-backend: device cuda was asked for")


@pytest.mark.timeout(200)
def test_bench_comm_to_target_reports_every_way(ran: Ran, folder: Path) -> None:
    """The rule for the target is in tests/unit/test_bench_comm_target.py."""
    proc = ran["comm target"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((folder / "comm_target.json").read_text())
    rows = {r["way"]: r for r in data["target_summary"]}
    assert set(rows) == {"fifo", "topk:0.01", "ddp"} and "skipped" in rows["ddp"]
    for way in ("fifo", "topk:0.01"):
        r = rows[way]
        assert 0 <= r["final"] <= 1 and r["steps"] == 20 and r["world_size"] == 1
        assert r["steps_to_target"] in (10, 20, None)
        assert set(r["time_to_target_s"]) == {"None"}  # loopback: one "rate"
    assert rows["fifo"]["gap"] == 0 and rows["fifo"]["steps_to_target"] is not None
    assert "less 1 point" in rows["fifo"]["target_rule"]
    assert "target = fifo's final accuracy" in proc.stdout
    assert "| mlp | topk:0.01 |" in proc.stdout


@pytest.mark.timeout(200)
def test_bench_infer_measures_and_writes_every_figure(ran: Ran, folder: Path) -> None:
    """The config, plans, turns and bars are in tests/unit/test_bench_infer.py."""
    proc = ran["infer"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training mlp" in proc.stderr and "batch prediction: mlp" in proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("│ mlp")]
    assert [line.split("│")[2].strip() for line in table[:3]] == ["fp32", "int8", "bf16"]
    assert "torch threads" in proc.stdout and "n/a   gpt int8" in proc.stdout
    got = json.loads((folder / "infer.json").read_text())
    assert set(got) >= {"config", "torch_threads", "rows", "prediction", "students", "bars",
                        "training", "worker_ratios"}  # fmt: skip
    assert [r["variant"] for r in got["rows"]] == ["fp32", "int8", "bf16"]
    assert set(got["rows"][0]) >= {"parameters", "model_bytes", "latency_p50_ms",
                                   "latency_p99_ms", "examples_per_s", "metric"}  # fmt: skip
    assert set(got["prediction"]["mlp"]["examples_per_s"]) == {"1", "2"}
    assert got["rows"][1]["model_bytes"] < got["rows"][0]["model_bytes"]  # int8 weighs less
    assert (folder / "runs" / "mlp" / infer_runs.OPTIONS_FILE).is_file()  # --runs keeps it

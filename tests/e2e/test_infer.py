"""`plait infer`: a trained run applied to inputs, against the model's own forward.

The backbone: whatever the number of workers, the lines written equal those of one process
applying the loaded model batch by batch, in input order, and the held-out metric equals
the one the run measured at its end. Also: sharded checkpoints, int8 and bf16, the kinds of
--data, a worker that dies (reported by shard, or retried), and the command line.

Three small runs (mlp, gpt, a user's own workload) are trained once for the module, in a
world of 2 ranks: what `plait train --out DIR` writes is what `train(config, comm)` with that
--out writes (the command itself is tested in tests/e2e/test_train_loop_command.py), and
ranks forked from a process that has imported torch (tests/support/world.py) cost seconds
less than the command's workers, which each import it. `plait infer` on the mlp run starts
as soon as they are trained, while the tests run; independent jobs run at once (threads).
What loads in this process without a worker is in tests/unit/test_infer_load.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import Communicator
from plait.cli.main import main as plait_command
from plait.errors import ConfigError
from plait.infer import InferError, load_run, model_bytes, predict, prepare
from plait.infer.rows import lines
from plait.train.config import TrainConfig
from plait.train.loop import train
from support.held_out import few_held_out_windows
from support.paths import ROOT
from support.world import run_world

DEADLINE = 120  # seconds for any one subprocess


# mlp and gpt are trained on the CPU wherever the tests run: on a GPU machine `auto` would
# give each of the two workers a GPU, and one GPU is refused to two ranks (PLAIT_SHARE_GPU);
# `custom` is the user's own workload, named relative to ROOT
TRAIN = {
    "mlp": {"model": "mlp", "steps": 30, "workers": 1, "device": "cpu"},
    "gpt": {"model": "gpt", "data": "synthetic", "steps": 4, "batch_size": 8, "workers": 2,
            "zero": 1, "device": "cpu"},
    "custom": {"workload": "examples/custom_workload.py:make", "steps": 3, "workers": 1},
}  # fmt: skip


def _at_once(*calls: Callable[[], Any]) -> list[Future[Any]]:
    """Run `calls` in threads at once and wait for them all; their futures, in order.

    For independent jobs: a job spends much of its time starting workers that import torch
    one after another, or on one core, while the other core would be idle."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [pool.submit(call) for call in calls]


def _train(comm: Communicator, root: str) -> None:
    """Each run of TRAIN into ROOT/NAME, as `plait train --out ROOT/NAME` trains it: gpt on
    both ranks (--zero 1: a sharded checkpoint), then rank 0 mlp and rank 1 the user's
    workload, each alone (on a communicator of its own), from ROOT."""
    few_held_out_windows()  # support/held_out.py: the gpt run's evaluation at its end
    train(TrainConfig.from_options({**TRAIN["gpt"], "out": f"{root}/gpt"}), comm)
    alone = comm.split(color=comm.rank)
    assert alone is not None
    name = ("mlp", "custom")[comm.rank]
    os.chdir(ROOT)  # where the workload's relative path resolves
    train(TrainConfig.from_options({**TRAIN[name], "out": f"{root}/{name}"}), alone)


@dataclass
class Trained:
    """Where the runs are (ROOT/NAME), and `plait infer` on the mlp run with --json, started
    as soon as the runs were trained (its files are in ROOT/infer): test_the_command_line
    reads how it ended."""

    root: Path
    infer: subprocess.Popen[str]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    root = tmp_path_factory.mktemp("runs")
    run_world(2, _train, str(root), timeout=DEADLINE, env={"PLAIT_TIMEOUT": "60"})
    (root / "infer").mkdir()
    infer = subprocess.Popen(
        [sys.executable, "-m", "plait", "infer", "--from", str(root / "mlp"),
         "--out", str(root / "infer" / "p.jsonl"), "--json", str(root / "infer" / "f.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    yield Trained(root, infer)
    infer.kill()
    infer.communicate()


@pytest.fixture(scope="module")
def runs(trained: Trained) -> dict[str, Path]:
    """The built-in models' runs: mlp (plain checkpoint), gpt (sharded: --zero 1)."""
    return {name: trained.root / name for name in ("mlp", "gpt")}


def _reference(
    run: Path, data: str = "val", batch: int = 256, limit: int | None = None
) -> list[str]:
    """The lines one process writes by calling the loaded model on each batch; with
    `limit`, the first `limit` of them, computing only the batches that hold them (the gpt
    run's training set has 3124 windows: computing them all cost most of this file's time)."""
    trained = load_run(run)
    d = trained.workload.data
    count = d.num_val if data == "val" else d.num_train
    read = d.val_batch if data == "val" else d.train_batch
    found = []
    with torch.no_grad():
        for lo in range(0, count if limit is None else min(limit, count), batch):
            x, y = read(torch.arange(lo, min(lo + batch, count)))
            found += lines(lo, trained.model(x), y)
    return found[:limit]


@pytest.fixture(scope="module")
def gpt_lines(runs: dict[str, Path]) -> list[str]:
    """The gpt run's first 50 training windows in batches of 8, as one process writes them:
    the reference of every gpt job below that predicts them in batches of 8 (the first 40
    or 24 are those of a job with that limit: the same batches)."""
    return _reference(runs["gpt"], "train", 8, limit=50)


def test_one_worker_writes_the_models_own_predictions_in_order(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "p.jsonl"
    result = predict(runs["mlp"], out=out, batch_size=100)
    written = out.read_text().splitlines(keepends=True)
    assert written == _reference(runs["mlp"], batch=100)
    rows = [json.loads(line) for line in written]
    assert [r["index"] for r in rows] == list(range(result.examples))
    assert set(rows[0]) == {"index", "class", "probability", "target"}
    # the metric over the held-out set is the one the run measured at its end
    assert result.metric == pytest.approx(load_run(runs["mlp"]).metric, abs=1e-9)
    assert len(result.latencies_ms) == 4  # 360 inputs in batches of 100
    assert not out.with_name(out.name + ".parts").exists()  # the shards are gone


def test_workers_write_what_one_process_writes(
    runs: dict[str, Path], gpt_lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 workers: shards of 17, 17 and 16 inputs (2 workers' clean job, in equal shards, is
    # the last one of test_a_dead_worker_is_named_and_its_shard_retried)
    out = tmp_path / "p.jsonl"
    result = predict(runs["gpt"], out=out, data="train", limit=50, workers=3, batch_size=8,
                     quiet=False)  # fmt: skip
    assert out.read_text().splitlines(keepends=True) == gpt_lines
    assert result.examples == 50 and result.workers == 3
    # the workers' progress events, summed over their shards (test_the_command_line's
    # command predicts in its own process)
    assert "50/50 inputs" in capsys.readouterr().err
    first = json.loads(out.read_text().splitlines()[0])
    assert set(first) == {"index", "next", "loss"} and len(first["next"]) == 64


def test_a_sharded_run_loads_as_its_consolidated_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    trained = load_run(runs["gpt"])
    assert trained.sharded and trained.step == 4
    # `plait checkpoint consolidate`'s own code, in this process: the command's process and
    # what it prints are tested in tests/e2e/test_sharded_checkpoint_command.py
    argv = ["checkpoint", "consolidate", str(runs["gpt"]), "-o", str(tmp_path / "w.pt")]
    assert plait_command(argv) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    for name, value in trained.model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_int8_and_bf16_are_smaller_and_close(runs: dict[str, Path], tmp_path: Path) -> None:
    trained = load_run(runs["mlp"])
    x, _ = trained.workload.data.val_batch(torch.arange(64))
    fp32 = trained.model(x)
    for quantize, precision, tol in (("int8", "fp32", 0.1), ("none", "bf16", 0.1)):
        made = prepare(trained.model, quantize, precision)
        assert model_bytes(made) < 0.6 * model_bytes(trained.model)
        out = made(x)
        assert out.dtype == torch.float32
        assert (out - fp32).abs().max() < tol * fp32.abs().max()
        agree = (out.argmax(1) == fp32.argmax(1)).float().mean()
        assert agree > 0.95, (quantize, precision, agree)
    assert trained.model(x).equal(fp32)  # prepare copies: the loaded model is untouched
    result = predict(runs["mlp"], out=tmp_path / "q.jsonl", quantize="int8")
    assert result.model_bytes < 0.6 * model_bytes(trained.model)
    assert abs(result.metric - trained.metric) < 0.03  # type: ignore[operator]


def test_data_files(runs: dict[str, Path], tmp_path: Path) -> None:
    trained = load_run(runs["mlp"])
    x, y = trained.workload.data.val_batch(torch.arange(10))
    torch.save(x, tmp_path / "x.pt")
    torch.save({"inputs": x, "targets": y}, tmp_path / "xy.pt")
    (tmp_path / "x.pt.txt").write_text("text")
    plain = predict(runs["mlp"], out=tmp_path / "a.jsonl", data=str(tmp_path / "x.pt"))
    rows = [json.loads(r) for r in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert plain.metric is None and plain.examples == 10 and "target" not in rows[0]
    assert [r["class"] for r in rows] == trained.model(x).argmax(1).tolist()
    labelled = predict(runs["mlp"], out=tmp_path / "b.jsonl", data=str(tmp_path / "xy.pt"))
    assert labelled.metric == pytest.approx((trained.model(x).argmax(1) == y).float().mean().item())
    with pytest.raises(ConfigError, match="vocabulary has 64 < 256 tokens"):
        predict(runs["gpt"], out=tmp_path / "c.jsonl", data=str(tmp_path / "x.pt.txt"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data": "missing.pt"}, "train (its training samples) or a file; there is no such file"),
        ({"data": "TEXT"}, "a model that is not a language model reads a .pt file"),
        ({"data": "BAD.pt"}, "expected a tensor of inputs or a dict with 'inputs'"),
        ({"workers": 3, "pp": 2}, "workers 3 % (pp 2 * tp 1) = 1 != 0"),
        ({"quantize": "int8", "tp": 2, "workers": 2}, "the int8 layers are not tensor-parallel"),
        ({"batch_size": 0}, "--batch-size 0 < 1"),
        ({"quantize": "int8", "device": "cuda"}, "torch's dynamic int8 layers run on the CPU"),
    ],
)
def test_bad_input_is_one_clear_error(
    runs: dict[str, Path], tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    (tmp_path / "TEXT").write_text("not images")
    torch.save({"x": torch.ones(2)}, tmp_path / "BAD.pt")
    data = options.get("data")
    if data is not None:
        options = {**options, "data": str(tmp_path / data)}
    with pytest.raises(ConfigError, match=re.escape(message)):
        predict(runs["mlp"], out=tmp_path / "p.jsonl", **options)
    assert not (tmp_path / "p.jsonl").exists()


def test_a_dead_worker_is_named_and_its_shard_retried(
    runs: dict[str, Path], gpt_lines: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two rounds of independent jobs at once: the variable is the whole process's, so
    # the jobs with a dying worker run together, then those without
    monkeypatch.setenv("PLAIT_INFER_DIE", "1:1")  # worker 1 dies after one batch, once
    out, retried = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    options = {"data": "train", "limit": 40, "workers": 2, "batch_size": 8}
    failing, retrying = _at_once(
        lambda: predict(runs["gpt"], out=out, **options),
        # --retry gives the dead worker's shard to a new worker within the job
        lambda: predict(runs["gpt"], out=retried, retry=1, **options),
    )
    with pytest.raises(InferError) as failed:
        failing.result()
    said = str(failed.value)
    assert "shard 1 (inputs 20..39): worker 1 killed by SIGKILL" in said
    assert "Written: inputs 0..19" in said and "--retry 1" in said
    parts = out.with_name(out.name + ".parts")
    assert not out.exists() and (parts / "shard-00000.jsonl").is_file()  # nothing lost
    left = shutil.copytree(parts, tmp_path / "left")  # what this job left, for another job
    reference = gpt_lines[:40]
    result = retrying.result()
    assert result.retried == [1] and result.reused == []
    assert retried.read_text().splitlines(keepends=True) == reference
    monkeypatch.delenv("PLAIT_INFER_DIE")
    # another job (here: another batch size) does not reuse what an earlier one left: the
    # first attempt's finished shard 0, put where this job's output keeps its shards
    other = tmp_path / "o.jsonl"
    shutil.copytree(left, other.with_name(other.name + ".parts"))
    # the same job again predicts only the shard that was lost
    again, another, by_4 = _at_once(
        lambda: predict(runs["gpt"], out=out, **options),
        lambda: predict(runs["gpt"], out=other, **{**options, "batch_size": 4}),
        lambda: _reference(runs["gpt"], "train", 4, limit=40),
    )
    assert again.result().reused == [0] and again.result().predicted == 20
    assert not parts.exists()
    assert out.read_text().splitlines(keepends=True) == reference
    result = another.result()
    assert result.reused == [] and result.predicted == 40 and result.workers == 2
    assert other.read_text().splitlines(keepends=True) == by_4.result()


def test_the_command_line(trained: Trained, tmp_path: Path) -> None:
    # `plait infer --from RUNS/mlp --out p.jsonl --json f.json`, started by the fixture: one
    # worker, so the command predicts in its own process (workers' progress events are
    # test_workers_write_what_one_process_writes's)
    stdout, stderr = trained.infer.communicate(timeout=DEADLINE)
    assert trained.infer.returncode == 0, stderr
    assert "wrote 360 predictions" in stdout and "held-out accuracy" in stdout
    assert "(the run measured" in stdout  # the held-out figure beside the run's own
    assert "360/360 inputs" in stderr  # progress, on stderr
    fig = json.loads((trained.root / "infer" / "f.json").read_text())
    for key in ("examples_per_s", "latency_p50_ms", "latency_p99_ms", "metric", "model_bytes"):
        assert key in fig
    # -X importtime: the modules the command imported, listed on stderr
    cmd = [sys.executable, "-X", "importtime", "-m", "plait", "infer", "--out", str(tmp_path / "p")]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE)
    assert bad.returncode == 2 and "--from DIR is required" in bad.stderr
    # answered before torch is imported: at once, not seconds later
    assert not re.search(r"\| +torch$", bad.stderr, re.MULTILINE)


def test_pipeline_and_tensor_parallel_workers_equal_one_process(
    runs: dict[str, Path], gpt_lines: list[str], tmp_path: Path
) -> None:
    reference = [json.loads(r) for r in gpt_lines[:24]]
    options = {"data": "train", "limit": 24, "batch_size": 8}
    pp, tp = tmp_path / "pp.jsonl", tmp_path / "tp.jsonl"
    pipeline, tensor_parallel = _at_once(
        lambda: predict(runs["gpt"], out=pp, workers=4, pp=2, chunks=3, **options),
        lambda: predict(runs["gpt"], out=tp, workers=2, tp=2, **options),
    )
    # dp 2 x pp 2: the pipeline's stages run the same float ops as the whole model
    pipeline.result()
    assert [json.loads(r) for r in pp.read_text().splitlines()] == reference
    # tp 2: the row-parallel layers sum partial products, which rounds differently
    result = tensor_parallel.result()
    rows = [json.loads(r) for r in tp.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(24))
    assert max(abs(r["loss"] - s["loss"]) for r, s in zip(rows, reference, strict=True)) < 1e-4
    assert result.metric == pytest.approx(sum(r["loss"] for r in reference) / 24, abs=1e-4)


def test_a_run_of_the_users_own_workload(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = trained.root / "custom"  # --workload examples/custom_workload.py:make, from ROOT
    monkeypatch.chdir(ROOT)  # the relative path resolves here
    result = predict(run, out=tmp_path / "p.jsonl")
    assert result.metric == pytest.approx(load_run(run).metric, abs=1e-9)
    monkeypatch.chdir(tmp_path)  # elsewhere the relative path does not resolve: say why
    with pytest.raises(ConfigError, match="run it where the run was trained"):
        predict(run, out=tmp_path / "q.jsonl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_cuda_without_a_gpu_is_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device cuda was asked for"):
        predict(runs["mlp"], out=tmp_path / "p.jsonl", device="cuda", workers=2)


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [1, 2])
def test_the_gpu_predicts_what_the_cpu_does(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    monkeypatch.setenv("PLAIT_SHARE_GPU", "1")  # two workers may share one GPU
    options = {"data": "train", "limit": 40, "batch_size": 8, "workers": workers}
    cpu = predict(runs["gpt"], out=tmp_path / "cpu.jsonl", device="cpu", **options)
    gpu = predict(runs["gpt"], out=tmp_path / "gpu.jsonl", device="cuda", **options)
    a = [json.loads(r) for r in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    b = [json.loads(r) for r in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert [r["index"] for r in b] == list(range(40))
    assert max(abs(r["loss"] - s["loss"]) for r, s in zip(a, b, strict=True)) < 1e-3
    assert gpu.metric == pytest.approx(cpu.metric, abs=1e-3)  # type: ignore[arg-type]

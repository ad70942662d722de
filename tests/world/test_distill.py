"""Knowledge distillation (`plait train --teacher DIR`): a distilled run under every strategy
against one process.

One world of 2 ranks (`battery`) trains a tiny teacher (rank 0 alone), then the same
distilled student alone, over --dp 2 and over --pp 2 (micro-batches cut the packed
targets), and runs gpt-small's packed targets through --tp 2 and --pp 2 against the whole
model. The real `plait train` command runs once, with --strategy ps and the world's
teacher, for the --json figures. The loss itself (Hinton et al.'s formula, and torch's own
cross-entropy and KL divergence at A = 0 and A = 1) is in tests/unit/test_distill_loss.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import Communicator
from plait.comm.mesh import Mesh
from plait.errors import CheckpointError
from plait.train import checkpoint, distill, job, workloads
from plait.train.config import DistillConfig, TrainConfig, WorkloadConfig
from plait.train.errors import ConfigError
from plait.train.loop import train
from plait.train.mesh_model import MeshModel
from plait.train.trained import load_run
from plait.train.workload import ACCURACY, Workload
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
TEACHER = {"model": "cnn", "data": "synthetic", "steps": 8, "batch_size": 16, "eval_every": 0}
STUDENT = {"model": "mlp", "data": "synthetic", "steps": 4, "batch_size": 16, "eval_every": 0,
           "distill_temperature": 4.0, "distill_weight": 0.7}  # fmt: skip


def _train(comm: Communicator, options: dict[str, Any]) -> Any:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    return train(config, comm).figures()


def _first_step_by_hand(teacher: str) -> tuple[float, dict[str, Any]]:
    """A = 1: T^2 KL of the teacher and the initial student on the first global batch, by
    hand, and the options of a run whose first loss should be that."""
    options = {**STUDENT, "teacher": teacher, "distill_weight": 1.0, "steps": 1}
    config = TrainConfig.from_options({**options, "workers": 1})
    work = workloads.resolve(config)
    x, _ = work.data.train_batch(work.sampler(work.data.num_train, 16, 0).shard(0, 0, 1))
    with torch.no_grad():
        s = work.build_model(0)(x)
        t = load_run(teacher).model(x)
    kd = 16.0 * F.kl_div(F.log_softmax(s / 4, -1), F.log_softmax(t / 4, -1),
                         reduction="batchmean", log_target=True)  # fmt: skip
    return float(kd), options


def _mesh_packed(comm: Communicator, name: str) -> dict[str, float]:
    """gpt-small's distillation loss with packed targets: whole, over --tp 2, over --pp 2."""
    work = workloads.build(name, 4, 0, 1, seed=0, data="synthetic")
    x, y = work.batch(0)
    torch.manual_seed(1)
    packed = distill.pack(torch.randn(*y.shape, work.dataset.vocab_size), y)  # type: ignore[attr-defined]
    loss = partial(distill.distillation_loss, temperature=2.0, weight=0.5)
    found = {"whole": float(loss(work.model()(x), packed))}
    for key, mesh, chunks in (("tp", Mesh(tp=2, comm=comm), 1), ("pp", Mesh(pp=2, comm=comm), 2)):
        value = MeshModel(work.model(), mesh, chunks=chunks, schedule="1f1b").step(x, packed, loss)
        if value is not None:
            found[key] = float(value)
    return found


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    teacher = f"{tmp}/teacher"
    alone = comm.split(ranks=[0])
    student = {**STUDENT, "teacher": teacher}
    results: dict[str, Any] = {}
    if alone is not None:
        _train(alone, {**TEACHER, "out": teacher})
        results["one"] = _train(alone, student)
        kd, options = _first_step_by_hand(teacher)
        results["a1"] = (kd, _train(alone, options)["losses"][0])
    comm.barrier()  # the teacher is on disk
    results["dp"] = _train(comm, student)
    results["pp"] = _train(comm, {**student, "pp": 2, "chunks": 4})
    results["mesh"] = _mesh_packed(comm, "gpt-small")
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("distill")
    return run_world(2, battery, str(tmp), timeout=150, env=ENV), tmp / "teacher"


@pytest.mark.timeout(200)
def test_distilled_runs_over_dp_and_pp_match_one_process(world: Any) -> None:
    results, _ = world
    one = results[0]["one"]["losses"]
    assert len(one) == STUDENT["steps"] and results[0]["one"]["teacher"]["model"] == "cnn"
    for kind in ("dp", "pp"):
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][kind]["losses"], one, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(200)
def test_with_weight_one_the_first_loss_is_the_teachers_kd_term(world: Any) -> None:
    kd, first = world[0][0]["a1"]
    assert first == pytest.approx(kd, rel=1e-5)


@pytest.mark.timeout(200)
def test_gpt_small_packed_targets_through_tp_and_pp(world: Any) -> None:
    results, _ = world
    whole = results[0]["mesh"]["whole"]
    assert results[0]["mesh"]["tp"] == pytest.approx(whole, rel=1e-5)
    assert results[1]["mesh"]["pp"] == pytest.approx(whole, rel=1e-5)  # the last stage's


@pytest.mark.timeout(200)
def test_bad_distillation_options_say_what_was_expected(world: Any, tmp_path: Path) -> None:
    _, teacher = world
    with pytest.raises(ConfigError, match="--distill-weight applies to distillation: give "
                       "--teacher DIR"):  # fmt: skip
        job.configure({"distill_weight": 0.3})
    with pytest.raises(ConfigError, match=r"--distill-weight 0\.3 apply to distillation"):
        TrainConfig(distill=DistillConfig(distill_weight=0.3))
    with pytest.raises(ConfigError, match="--distill-temperature 0 is not > 0"):
        DistillConfig(teacher="x", distill_temperature=0.0)
    with pytest.raises(ConfigError, match=r"--distill-weight 1.5 is not in \[0, 1\]"):
        DistillConfig(teacher="x", distill_weight=1.5)
    with pytest.raises(CheckpointError, match=r"holds no trained run: expected checkpoint\.pt"):
        job.configure({"teacher": str(tmp_path), "workers": 1})
    cpu = torch.device("cpu")
    digits = TrainConfig.from_options({"model": "mlp", "data": "digits", "teacher": str(teacher)})
    with pytest.raises(ConfigError, match="trained on --data synthetic, the student on --data "
                       "digits"):  # fmt: skip
        distill.load(digits, workloads.resolve(digits), cpu)
    text = TrainConfig.from_options({"model": "gpt-small", "data": "synthetic",
                                     "teacher": str(teacher)})  # fmt: skip
    with pytest.raises(ConfigError, match="does image classification, the student"):
        distill.load(text, workloads.resolve(text), cpu)
    data = workloads.builtin("mlp", "synthetic").data
    five = Workload(name="five", data=data, loss=F.cross_entropy, metric=ACCURACY,
                    model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 5)))  # fmt: skip
    given = TrainConfig(workload=WorkloadConfig(given=True),
                        distill=DistillConfig(teacher=str(teacher)))  # fmt: skip
    with pytest.raises(ConfigError, match=r"shape \(2, 10\), the student \(five\) \(2, 5\)"):
        distill.load(given, five, cpu)
    assert "teacher" in checkpoint.MUST_MATCH
    with pytest.raises(CheckpointError, match=r"--teacher 'a'.*this run has --teacher None"):
        checkpoint.check_matches({"options": {"teacher": "a"}}, {"teacher": None}, "d")


@pytest.mark.timeout(200)
def test_the_command_reports_the_teacher_in_its_header_and_json(world: Any, tmp_path: Path) -> None:
    _, teacher = world
    figures = tmp_path / "run.json"
    args = ["--model", "mlp", "--data", "synthetic", "--teacher", str(teacher), "--strategy",
            "ps", "--workers", "2", "--servers", "1", "--steps", "3", "--batch-size", "16",
            "--distill-temperature", "4", "--distill-weight", "0.7",
            "--json", str(figures)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "plait", "train", *args],
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"distilled from {teacher}: cnn, " in done.stdout
    assert "(T 4, weight 0.7)" in done.stdout
    got = json.loads(figures.read_text())
    assert got["distill_temperature"] == 4.0 and got["distill_weight"] == 0.7
    t = got["teacher"]
    assert t["dir"] == str(teacher) and t["model"] == "cnn"
    assert t["parameters"] == load_run(teacher).parameters
    assert set(t) >= {"dir", "model", "parameters", "metric"} and len(got["losses"]) == 3

"""What plait answers to the mistakes a new user makes, in-process: through cli/main.py's
parser and `plait train`'s configure path, before any worker would start (issue 34's list;
the Ctrl-C line is checked in tests/e2e/test_launch.py, where a launcher is signalled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plait import env
from plait.cli.main import main, version
from plait.errors import CheckpointError, ConfigError
from plait.train import checkpoint, job, saved

FAST = {"data": "synthetic", "steps": 6}  # a workload that loads at once


def _saved_run(out: Path, **options: Any) -> Path:
    """A checkpoint as a finished run of `options` writes it (no weights: not read here)."""
    config = job.configure({**FAST, **options})
    state = {"step": config.steps, "options": config.options(), "model": {}, "losses": [],
             "evals": [], "rng": checkpoint.rng_state()}  # fmt: skip
    return checkpoint.save(out, state)


def test_version_usage_and_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"plait {version()}\n"
    with pytest.raises(SystemExit):
        main(["train", "--nosuch-flag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: plait train ")  # the command's usage, not plait's
    assert err.rstrip().endswith("plait train: error: unrecognized arguments: --nosuch-flag")
    with pytest.raises(SystemExit):
        main(["train", "--bach-size", "3"])
    assert "--bach-size: did you mean --batch-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "-n", "2"])
    assert "plait run: error: what program should every rank run?" in capsys.readouterr().err


def test_the_environment_is_checked_first(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = (["train"], ["run", "-n", "2", "x.py"], ["infer"], ["bench", "ps"], ["train"])
    for command, (name, value, message) in zip(commands, [
        ("PLAIT_TIMEOUT", "abc", "PLAIT_TIMEOUT must be a number of seconds; got 'abc'"),
        ("PLAIT_HEARTBEAT_TIMEOUT", "-1", "PLAIT_HEARTBEAT_TIMEOUT must be > 0 seconds; got '-1'"),
        ("PLAIT_DEVICE", "gpu", "PLAIT_DEVICE must be auto, cpu or cuda; got 'gpu'"),
        ("PLAIT_ELASTIC_MAX", "0", "PLAIT_ELASTIC_MAX must be an integer >= 1; got '0'"),
        ("PLAIT_TRAIN_KILL_AT", "3", "PLAIT_TRAIN_KILL_AT must be RANK:N; got '3'"),
    ], strict=True):  # fmt: skip
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert main(command) == 2  # each command that starts workers, before it does
            assert capsys.readouterr().err == f"plait {command[0]}: error: {message}\n"
            with pytest.raises(ConfigError, match=message):
                job.configure({})  # train() from Python too
    env.check({"PLAIT_TRAIN_STRAGGLER": "transient:2.5", "PLAIT_TRAIN_NAN_AT": "3:1"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "1f1b"}, "--schedule 1f1b applies to a pipeline (--pp 2 or more)"),
        ({"chunks": 4, "schedule": "gpipe"}, "--schedule gpipe and --chunks 4 apply to"),
        ({"model": "gpt", "tp": 3, "workers": 3}, "--tp 3: blocks.0.attn: n_head 4 % tp 3"),
        ({"model": "gpt", "pp": 8, "workers": 8}, "--pp 8: the model has 6 layers to cut into 8"),
        (
            {"model": "mlp", "pp": 2, "schedule": "interleaved"},
            "pipeline rank 0 would hold only layers without parameters (Flatten, ReLU)",
        ),
        ({"batch_size": 0}, "--batch-size 0 < 1"),
        ({"resume": True}, "--resume needs --out DIR"),
    ],
)
def test_checks_before_any_worker(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        job.configure({**FAST, **options})


def test_a_resume_is_checked_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = _saved_run(tmp_path)
    resume = {**FAST, "out": str(tmp_path), "resume": True}
    with pytest.raises(CheckpointError, match="with --batch-size 64, this run has --batch-size"):
        job.configure({**resume, "batch_size": 32})
    assert job.configure({**resume, "steps": 9}).steps == 9  # a longer run goes on
    assert job.run(resume) == 0  # a finished run: nothing to train, not a summary of nothing
    assert "has done step 6 of --steps 6 already: there is nothing to train" in (
        capsys.readouterr().out
    )
    where.write_bytes(where.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt has 100 bytes; .* truncated"):
        job.configure({**resume, "steps": 9})


def test_a_teacher_of_another_task_is_refused_up_front(tmp_path: Path) -> None:
    (tmp_path / "teacher").mkdir()
    _saved_run(tmp_path / "teacher", model="gpt")
    with pytest.raises(ConfigError, match=r"\(gpt\) does language modelling, the student"):
        job.configure({**FAST, "teacher": str(tmp_path / "teacher")})
    saved.sum_path(tmp_path / "teacher" / "checkpoint.pt").unlink()
    (tmp_path / "teacher" / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt is empty"):
        job.configure({**FAST, "teacher": str(tmp_path / "teacher")})


def test_infer_takes_the_runs_data_by_name() -> None:
    from plait.infer.inputs import open_inputs
    from plait.train import workloads

    work = workloads.builtin("mlp", "synthetic")
    assert open_inputs("synthetic", work).name == "synthetic (held-out)"  # as val
    with pytest.raises(ConfigError, match="the run trained on synthetic, not digits"):
        open_inputs("digits", work)

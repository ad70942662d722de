"""Checkpoints are written atomically: a crash mid-write leaves the previous one intact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from plait.train import checkpoint, saved
from plait.train.errors import CheckpointError


def _state(step: int) -> dict[str, object]:
    return {"step": step, "model": {"w": torch.full((3,), float(step))}, "losses": [1.0] * step}


def test_save_and_load(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _state(3))
    got = checkpoint.load(tmp_path)
    assert got["step"] == 3 and torch.equal(got["model"]["w"], torch.full((3,), 3.0))
    # no temporary left; the sidecar holds its size and sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.sum"]


def test_crash_mid_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.save(tmp_path, _state(1))
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def torn_write(obj: object, f: object) -> None:
        f.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise KeyboardInterrupt  # the process is being killed mid-write

    monkeypatch.setattr(torch, "save", torn_write)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, _state(2))
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert checkpoint.load(tmp_path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.sum"]
    saved.check_plain(tmp_path / "checkpoint.pt")  # the sidecar says a save was under way


def test_a_killed_writer_leaves_only_a_temporary(tmp_path: Path) -> None:
    # SIGKILL between write and rename: the temporary stays, the checkpoint is the old one
    checkpoint.save(tmp_path, _state(1))
    (tmp_path / ".checkpoint.pt.abc.tmp").write_bytes(b"garbage")
    assert checkpoint.load(tmp_path)["step"] == 1


def test_disk_errors_become_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.save(tmp_path, _state(1))

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        checkpoint.save(tmp_path, _state(2))
    monkeypatch.undo()
    assert checkpoint.load(tmp_path)["step"] == 1
    assert len(list(tmp_path.iterdir())) == 2  # the checkpoint and its sidecar
    saved.check_plain(tmp_path / "checkpoint.pt")


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt is not a checkpoint torch\.save"):
        checkpoint.load(tmp_path)


def test_a_damaged_checkpoint_is_named_with_the_reason(tmp_path: Path) -> None:
    where = checkpoint.save(tmp_path, _state(3))
    whole = where.read_bytes()
    where.write_bytes(whole[:1000])
    with pytest.raises(CheckpointError, match=f"has 1000 bytes; .* says {len(whole)}: the file "
                       "is truncated"):  # fmt: skip
        saved.check_plain(where)
    where.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # one bit flipped
    with pytest.raises(CheckpointError, match="is corrupt: its sha256 is"):
        saved.check_plain(where)
    saved.sum_path(where).unlink()  # a checkpoint written before the sidecars existed
    where.write_bytes(whole)
    saved.check_plain(where)
    for data, why in ((b"", "is empty"), (whole[:1000], "is truncated or damaged")):
        where.write_bytes(data)
        with pytest.raises(CheckpointError, match=f"checkpoint.pt {why}"):
            saved.check_plain(where)
        with pytest.raises(CheckpointError, match=f"checkpoint.pt {why}"):
            checkpoint.load(tmp_path)  # a worker's load says why too


def test_resume_needs_the_same_data_stream() -> None:
    saved = {"options": {"model": "mlp", "data": "digits", "batch_size": 64, "seed": 0}}
    checkpoint.check_matches(saved, {**saved["options"], "workers": 2}, "d")
    with pytest.raises(CheckpointError, match="--batch-size 64, this run has --batch-size 32"):
        checkpoint.check_matches(saved, {**saved["options"], "batch_size": 32}, "d")

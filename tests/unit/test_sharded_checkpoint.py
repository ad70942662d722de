"""Sharded checkpoints: save at one world size, load at another, consolidate, fail clearly.

N ranks are simulated in one process (tests/support/sharded_states.py): a full model's
parameters (and fake Adam state) are cut into each rank's shards with torch's own padding
and chunking, independently of the loader; every loaded shard must equal the direct cut at
the new world size exactly. `plait checkpoint consolidate` is in
tests/e2e/test_sharded_checkpoint_command.py.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.cli.main import main
from plait.sharded import checkpoint
from plait.sharded.layout import Layout
from plait.train.errors import CheckpointError
from support.sharded_states import LAYOUT, Model, save_all


def assert_rank_equals(got: checkpoint.Loaded, model: Model, r: int, world: int) -> None:
    shards, optim = model.rank(r, world)
    assert len(got.shards) == len(shards)
    for u, (a, b) in enumerate(zip(got.shards, shards, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"unit {u} shard of rank {r}/{world}"
    for u, (a, b) in enumerate(zip(got.optim, optim, strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (u, k, r, world)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------------- resharding
@pytest.mark.parametrize("saved", [4, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_load_at_another_world_size_equals_the_direct_cut(
    tmp_path: Path, saved: int, world: int
) -> None:
    model = Model()
    save_all(tmp_path, model, saved, pad=float("nan"))  # the saved padding must not leak
    for r in range(world):
        got = checkpoint.load(tmp_path, r, world, LAYOUT)
        assert_rank_equals(got, model, r, world)  # zero padding, exactly the cut
        assert got.common["step"] == 12 and got.common["losses"] == [1.5, 1.25]
        assert torch.equal(
            got.common["buffers"]["norm.running_mean"], model.buffers["norm.running_mean"]
        )


@pytest.mark.parametrize(
    "rank, world, reads",
    [(1, 4, [1]), (0, 2, [0, 1]), (1, 2, [2, 3]), (2, 3, [2, 3]), (0, 1, [0, 1, 2, 3])],
)
def test_a_rank_reads_only_the_old_files_its_shards_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, world: int, reads: list[int]
) -> None:
    save_all(tmp_path, Model(), 4)
    read: list[str] = []
    real = torch.load

    def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
        read.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    checkpoint.load(tmp_path, rank, world, LAYOUT)
    expected = [f"checkpoint.g1.rank{q}-of-4.pt" for q in reads] + ["checkpoint.g1.common.pt"]
    assert read == expected  # each once, and old rank 0's only where it overlaps


def test_save_with_barriers_from_threads(tmp_path: Path) -> None:
    # save() itself, with every rank's two barriers: four threads stand in for four ranks
    model, world = Model(), 4
    barrier = threading.Barrier(world, timeout=30)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            shards, optim = model.rank(r, world)
            checkpoint.save(tmp_path, r, world, LAYOUT, shards, optim, model.common, barrier.wait)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # committed: the manifest, a file per rank, the common file; no sidecar, no temporary
    assert files(tmp_path) == [
        "checkpoint.g1.common.pt", *[f"checkpoint.g1.rank{r}-of-4.pt" for r in range(4)],
        "checkpoint.json",
    ]  # fmt: skip
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    assert manifest["world"] == 4 and manifest["generation"] == 1
    assert Layout.from_json(manifest["layout"]) == LAYOUT
    assert manifest["parameters"] == sum(p.numel() for p in model.params.values())
    assert_rank_equals(checkpoint.load(tmp_path, 1, 2, LAYOUT), model, 1, 2)


def test_a_new_save_replaces_the_old_one(tmp_path: Path) -> None:
    save_all(tmp_path, Model(seed=1), 4)
    newer = Model(seed=2)
    save_all(tmp_path, newer, 2)  # resumed at 2 ranks, saved again
    assert files(tmp_path) == [
        "checkpoint.g2.common.pt", "checkpoint.g2.rank0-of-2.pt", "checkpoint.g2.rank1-of-2.pt",
        "checkpoint.json",
    ]  # fmt: skip
    for r in range(3):
        assert_rank_equals(checkpoint.load(tmp_path, r, 3, LAYOUT), newer, r, 3)


def test_a_view_saves_only_itself(tmp_path: Path) -> None:
    # a stage-1 shard is a view of its unit's full vector: saving it must not save the rest
    model = Model()
    for r in range(2):
        shards, optim = model.rank(r, 2)
        full = torch.zeros(1_000_000)  # (the full vector: 4 MB)
        views, at = [], 0
        for s in shards:
            full[at : at + s.numel()] = s
            views.append(full[at : at + s.numel()])
            at += s.numel()
        checkpoint.save_rank(tmp_path, r, 2, LAYOUT, views, optim, model.common)
    checkpoint.commit(tmp_path, 2, LAYOUT)
    assert (tmp_path / "checkpoint.g1.rank0-of-2.pt").stat().st_size < 20_000  # not 4 MB
    assert_rank_equals(checkpoint.load(tmp_path, 0, 3, LAYOUT), model, 0, 3)


def test_no_optimizer_state_yet_and_a_16_bit_dtype(tmp_path: Path) -> None:
    # before the first step Adam holds no state; the shards' dtype is kept as saved
    model = Model()
    for r in range(4):
        shards = [t.to(torch.bfloat16) for t in model.rank(r, 4)[0]]
        checkpoint.save_rank(tmp_path, r, 4, LAYOUT, shards, [{} for _ in shards])
    checkpoint.commit(tmp_path, 4, LAYOUT)
    got = checkpoint.load(tmp_path, 2, 3, LAYOUT)
    assert got.optim == [{}] * len(LAYOUT.units) and got.common == {}
    expected = [t.to(torch.bfloat16) for t in model.rank(2, 3)[0]]
    assert all(
        a.dtype == torch.bfloat16 and torch.equal(a, b)
        for a, b in zip(got.shards, expected, strict=True)
    )


# --------------------------------------------------------------------------- crashes
def test_a_save_that_dies_before_its_commit_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = Model(seed=1), Model(seed=2)
    save_all(tmp_path, old, 4)
    # generation 2: ranks 0 and 1 wrote their files, rank 2 died mid-write, no commit
    for r in (0, 1):
        shards, optim = new.rank(r, 4)
        checkpoint.save_rank(tmp_path, r, 4, LAYOUT, shards, optim, new.common)

    def torn(obj: object, f: Any) -> None:
        f.write(b"half a shard")
        raise KeyboardInterrupt  # the process is killed mid-write

    with monkeypatch.context() as m:
        m.setattr(torch, "save", torn)
        shards, optim = new.rank(2, 4)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_rank(tmp_path, 2, 4, LAYOUT, shards, optim)
    assert "checkpoint.g2.rank0-of-4.pt" in files(tmp_path)
    assert not (tmp_path / "checkpoint.g2.rank2-of-4.pt").exists()  # the temporary is gone
    for r in range(2):
        assert_rank_equals(checkpoint.load(tmp_path, r, 2, LAYOUT), old, r, 2)
    assert torch.equal(checkpoint.consolidate(tmp_path)["embed"], old.params["embed"])

    # a commit now would find rank 2's file missing, and says so
    with pytest.raises(CheckpointError, match=r"rank2-of-4\.pt"):
        checkpoint.commit(tmp_path, 4, LAYOUT)
    assert_rank_equals(checkpoint.load(tmp_path, 0, 4, LAYOUT), old, 0, 4)

    # the run restarts at 2 ranks and saves: generation 2 again; the leftovers are deleted
    save_all(tmp_path, new, 2)
    assert files(tmp_path) == [
        "checkpoint.g2.common.pt", "checkpoint.g2.rank0-of-2.pt", "checkpoint.g2.rank1-of-2.pt",
        "checkpoint.json",
    ]  # fmt: skip
    assert_rank_equals(checkpoint.load(tmp_path, 2, 4, LAYOUT), new, 2, 4)


def test_a_crash_before_the_first_commit_is_no_checkpoint(tmp_path: Path) -> None:
    shards, optim = Model().rank(0, 2)
    checkpoint.save_rank(tmp_path, 0, 2, LAYOUT, shards, optim)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint.*never finished"):
        checkpoint.load(tmp_path, 0, 2, LAYOUT)


# ---------------------------------------------------------------------- consolidate
def test_consolidate_equals_the_state_dict(tmp_path: Path) -> None:
    model = Model()
    save_all(tmp_path, model, 3)
    state = checkpoint.consolidate(tmp_path)
    expected = {**model.params, **model.buffers}
    assert list(state) == list(expected)
    for name, t in expected.items():
        assert state[name].shape == t.shape and torch.equal(state[name], t), name
    for name in model.params:  # each parameter its own tensor (safetensors refuses shared ones)
        t = state[name]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_the_command_explains_a_bad_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "checkpoint.pt").write_bytes(b"")  # a run without sharding
    assert main(["checkpoint", "consolidate", str(tmp_path), "-o", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait checkpoint: error: ") and "plain one" in err
    assert not (tmp_path / "m.pt").exists()
    assert main(["checkpoint", "consolidate", str(tmp_path), "-o", "/no/such/dir/m.pt"]) == 2
    assert "cannot write -o '/no/such/dir/m.pt'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- errors
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_all(tmp_path, Model(), 4)
    return tmp_path


def test_a_missing_file_is_named_on_every_rank(saved: Path) -> None:
    (saved / "checkpoint.g1.rank2-of-4.pt").unlink()
    for r in range(4):  # rank 0 at world 4 reads no rank 2's file, and fails all the same
        with pytest.raises(
            CheckpointError, match=r"checkpoint\.g1\.rank2-of-4\.pt, which is missing"
        ):
            checkpoint.load(saved, r, 4, LAYOUT)
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.consolidate(saved)


def test_a_truncated_file_is_named(saved: Path) -> None:
    path = saved / "checkpoint.g1.rank1-of-4.pt"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}.*truncated"):
        checkpoint.load(saved, 0, 2, LAYOUT)


def test_a_corrupt_file_is_named(saved: Path) -> None:
    path = saved / "checkpoint.g1.common.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is corrupt: its sha256"):
        checkpoint.load(saved, 0, 4, LAYOUT)


def test_another_models_checkpoint_names_the_first_differing_parameter(saved: Path) -> None:
    other = Layout.of([(u.name, [(e.name, (8, 4) if e.name == "blocks.0.w" else e.shape)
                       for e in u.entries], u.dtype) for u in LAYOUT.units])  # fmt: skip
    message = (
        f"checkpoint {re.escape(str(saved / 'checkpoint.json'))} "
        r"holds parameter 'blocks.0.w' of shape \(3, 5\); "
        r"this model's is \(8, 4\); it loads only into the model that wrote it"
    )
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(saved, 0, 4, other)


def test_an_altered_manifest_layout_is_refused(saved: Path) -> None:
    path = saved / "checkpoint.json"
    manifest = json.loads(path.read_text())
    manifest["layout"]["units"][3]["params"][0] = ["embed", [3, 11]]
    path.write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"'embed' of shape \(3, 11\); this model's is \(11, 3\)"
    ):
        checkpoint.load(saved, 0, 2, LAYOUT)


@pytest.mark.parametrize(
    "change, message",
    [
        ([("blocks.0.w", (3, 5)), ("blocks.0.c", (5,))], r"holds no parameter 'blocks.0.c'"),
        ([("blocks.0.w", (3, 5))], r"parameter 'blocks.0.b' of shape \(5,\); this model has none"),
        ([("blocks.0.b", (5,)), ("blocks.0.w", (3, 5))], r"groups its parameters otherwise"),
    ],
)  # fmt: skip
def test_other_layout_differences(
    saved: Path, change: list[tuple[str, tuple[int, ...]]], message: str
) -> None:
    units = [(u.name, [(e.name, e.shape) for e in u.entries], u.dtype) for u in LAYOUT.units]
    units[0] = (units[0][0], change, "float32")
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(saved, 0, 4, Layout.of(units))


def test_another_dtype_is_another_model(saved: Path) -> None:
    units = [(u.name, [(e.name, e.shape) for e in u.entries], "bfloat16") for u in LAYOUT.units]
    with pytest.raises(
        CheckpointError, match=r"'blocks\.0\.w' as float32; this model's is bfloat16"
    ):
        checkpoint.load(saved, 0, 4, Layout.of(units))


def test_a_directory_without_a_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="the directory does not exist"):
        checkpoint.load(tmp_path / "nope", 0, 1, LAYOUT)
    with pytest.raises(CheckpointError, match=r"checkpoint\.json does not exist"):
        checkpoint.load(tmp_path, 0, 1, LAYOUT)
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"plain one, .*checkpoint\.pt.*torch\.load"):
        checkpoint.consolidate(tmp_path)


def test_an_unreadable_manifest(saved: Path) -> None:
    (saved / "checkpoint.json").write_text('{"format": 1, "world": ')
    with pytest.raises(
        CheckpointError, match=r"cannot read the checkpoint manifest .*checkpoint\.json"
    ):
        checkpoint.load(saved, 0, 4, LAYOUT)
    (saved / "checkpoint.json").write_text('{"format": 99}')
    with pytest.raises(CheckpointError, match="has format 99; this plait reads format 1"):
        checkpoint.load(saved, 0, 4, LAYOUT)


def test_a_shard_of_the_wrong_shape_is_not_saved(tmp_path: Path) -> None:
    shards, optim = Model().rank(0, 4)
    shards[0] = shards[0][:-1]
    with pytest.raises(
        CheckpointError,
        match=r"'blocks.0'.*shape \(4,\); at world size 4 it is \(5,\) \(padded 20 / 4\)",
    ):
        checkpoint.save_rank(tmp_path, 0, 4, LAYOUT, shards, optim)
    assert files(tmp_path) == []

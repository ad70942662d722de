"""Mesh checkpoints (plait/sharded/mesh_checkpoint.py) in one process: a whole model's state
cut to every 4-rank mesh shape, with and without ZeRO, saved as each rank would, read back
whole and cut again to every shape: exactly the parts cut directly. Also the errors that
name a file, what `plait train --resume` reads (resumable.py), and DCP directories
(resume_sources.py). The training runs that save and resume on a mesh are in
tests/world/test_train_mesh.py."""

from __future__ import annotations

import itertools
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import CheckpointError
from plait.sharded import mesh_checkpoint as fmt
from plait.sharded.layout import Layout
from plait.train import resumable
from plait.train.resume_sources import catalog_of, open_source, plain_state

# a small model as one process holds it: name -> (whole shape, the dimension tp cuts);
# 4 layers (a pipeline of 4 cuts one each), every tp-cut size divisible by 4
PARAMS = {
    "emb.weight": ((8, 4), None),
    "b0.fc.weight": ((8, 4), 0), "b0.fc.bias": ((8,), 0), "b0.proj.weight": ((4, 8), 1),
    "b0.proj.bias": ((4,), None),
    "b1.fc.weight": ((8, 4), 0), "b1.fc.bias": ((8,), 0), "b1.proj.weight": ((4, 8), 1),
    "b1.proj.bias": ((4,), None),
    "head.weight": ((6, 4), None),
}  # fmt: skip
LAYERS = [["emb.weight"], [n for n in PARAMS if n.startswith("b0")],
          [n for n in PARAMS if n.startswith("b1")], ["head.weight"]]  # fmt: skip
SHAPES = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]  # (dp, pp, tp)
STEP = torch.tensor(3.0)


def whole_state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, (s, _) in PARAMS.items()}
    moments = {n: torch.randn(s, generator=g) for n, (s, _) in PARAMS.items()}
    return params, moments


def stage_of(name: str, pp: int) -> int:
    layer = next(i for i, names in enumerate(LAYERS) if name in names)
    return layer * pp // len(LAYERS)


def tp_cut(t: torch.Tensor, name: str, index: int, tp: int) -> torch.Tensor:
    """A tp slice as plait.tensor_parallel's layers take it (`from_linear`'s chunk)."""
    dim = PARAMS[name][1]
    return t if dim is None else t.chunk(tp, dim=dim)[index]


def units_of(pp_index: int, pp: int) -> list[list[str]]:
    """ZeRO's units of a stage: one per layer."""
    return [names for names in LAYERS if stage_of(names[0], pp) == pp_index]


def zero_cut(tensors: list[torch.Tensor], d: int, dp: int) -> torch.Tensor:
    """ZeRO's shard by its definition: the unit's tensors end to end, zero-padded to a
    multiple of dp ranks, cut in dp equal parts."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    padded = -(-flat.numel() // dp) * dp
    return F.pad(flat, (0, padded - flat.numel())).chunk(dp)[d]


def save_at(folder: Path, shape: tuple[int, int, int], zero: bool, seed: int = 0) -> None:
    """Save the whole state as every rank of `shape` would, then rank 0's commit."""
    params, moments = whole_state(seed)
    dp, pp, tp = shape
    generation = 1
    described = []
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        mine = [n for n in PARAMS if stage_of(n, pp) == p]
        local = {n: tp_cut(params[n], n, t, tp) for n in mine}
        moment = {n: tp_cut(moments[n], n, t, tp) for n in mine}
        part: dict[str, Any] = {}
        layout = None
        if zero:
            units = units_of(p, pp)
            part["units"] = [
                {"shard": zero_cut([local[n] for n in u], d, dp),
                 "optim": {"exp_avg": zero_cut([moment[n] for n in u], d, dp), "step": STEP}}
                for u in units
            ]  # fmt: skip
            layout = Layout.of([(u[0].rpartition(".")[0], [(n, tuple(local[n].shape)) for n in u],
                                 "float32") for u in units]).to_json()  # fmt: skip
            written = mine
        elif d == 0:
            written = [n for n in mine if PARAMS[n][1] is not None or t == 0]
            part["params"] = {n: local[n] for n in written}
            part["optim"] = {n: {"exp_avg": moment[n], "step": STEP} for n in written}
        else:
            written = []
        buffers = ["emb.count"] if (d, t) == (0, 0) and p == 0 else []
        if buffers:
            part["buffers"] = {"emb.count": torch.tensor([7, seed])}
        common = {"step": 2, "param_groups": [{"lr": 0.1}]} if (d, p, t) == (0, 0, 0) else None
        name = fmt.save_part(folder, generation, (d, p, t), shape, part, common)
        described.append({"coords": [d, p, t], "file": name, "params": written,
                          "buffers": buffers, "layout": layout})  # fmt: skip
    catalog = [fmt.Param(n, s, "float32", stage_of(n, pp), dim) for n, (s, dim) in PARAMS.items()]
    fmt.commit(folder, generation, shape, 1 if zero else 0, catalog, described)


SAVED = [(shape, zero) for shape in SHAPES for zero in (False, True)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Any, bool], Path]:
    found = {}
    for shape, zero in SAVED:
        folder = tmp_path_factory.mktemp("x".join(map(str, shape)) + ("-zero" if zero else ""))
        save_at(folder, shape, zero)
        found[(shape, zero)] = folder
    return found


@pytest.mark.parametrize(("shape", "zero"), SAVED)
def test_every_shape_reads_back_whole_and_cuts_to_every_shape_exactly(
    saved: dict[tuple[Any, bool], Path], shape: tuple[int, int, int], zero: bool
) -> None:
    params, moments = whole_state()
    m = fmt.read_manifest(saved[(shape, zero)])
    assert (m.shape, m.zero) == (shape, int(zero))
    files = fmt.MeshFiles(m)
    for n in PARAMS:
        assert torch.equal(files.tensor(n), params[n]), n
        state = files.optim(n)
        assert torch.equal(state["exp_avg"], moments[n]) and torch.equal(state["step"], STEP)
    assert torch.equal(files.buffers()["emb.count"], torch.tensor([7, 0]))
    for (_, _, tp), n in itertools.product(SHAPES, PARAMS):  # each rank's part elsewhere
        for t in range(tp):
            assert torch.equal(fmt.tp_slice(files.tensor(n), PARAMS[n][1], t, tp),
                               tp_cut(params[n], n, t, tp))  # fmt: skip
    for dp, pp, tp in SHAPES:  # and its ZeRO shards, as flat_shard cuts them
        for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
            for u, unit in enumerate(units_of(p, pp)):
                local = {n: tp_cut(files.tensor(n), n, t, tp) for n in unit}
                lay = Layout.of([("", [(n, tuple(local[n].shape)) for n in unit], "float32")])
                got = fmt.flat_shard(lay.units[0], d, dp, local.__getitem__)
                want = zero_cut([tp_cut(params[n], n, t, tp) for n in unit], d, dp)
                assert torch.equal(got, want), (d, p, t, u)


def test_consolidate_gives_the_whole_state_dict(saved: dict[tuple[Any, bool], Path]) -> None:
    params, _ = whole_state()
    state = fmt.consolidate(saved[((1, 2, 2), True)])
    assert list(state) == [*PARAMS, "emb.count"]
    assert all(torch.equal(state[n], params[n]) for n in PARAMS)
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in params.values())


def test_the_command_consolidates_a_mesh_checkpoint(
    saved: dict[tuple[Any, bool], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.cli.main import main

    assert main(["checkpoint", "consolidate", str(saved[((2, 2, 1), False)]),
                 "-o", str(tmp_path / "m.pt")]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert "saved on a dp 2 x pp 2 x tp 1 mesh, 10 parameters" in err
    assert out.startswith(f"wrote {tmp_path / 'm.pt'}: 10 parameters (208 values), 1 buffers")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(state[n], t) for n, t in whole_state()[0].items())


def test_a_missing_truncated_or_changed_file_is_named(
    saved: dict[tuple[Any, bool], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(saved[((2, 2, 1), True)], folder)
    victim = folder / "checkpoint.g1.dp1-pp1-tp0-of-2x2x1.pt"
    data = victim.read_bytes()
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"names {victim}, which is missing"):
        resumable.check(folder, on_mesh=True, zero=0)  # before any worker starts
    victim.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=f"{victim} has 100 bytes; .* truncated"):
        fmt.MeshFiles(fmt.read_manifest(folder))
    victim.write_bytes(data[:-9] + bytes(9))
    files = fmt.MeshFiles(fmt.read_manifest(folder))  # the size is right: read, then found
    with pytest.raises(CheckpointError, match=f"{victim} is corrupt: its sha256"):
        files.tensor("head.weight")


def test_another_models_checkpoint_is_refused(saved: dict[tuple[Any, bool], Path]) -> None:
    catalog = [(n, s, "float32") for n, (s, _) in PARAMS.items()]
    catalog[1] = ("b0.fc.weight", (16, 4), "float32")
    with pytest.raises(CheckpointError, match=r"holds parameter 'b0.fc.weight' of shape \(8, 4\)"):
        open_source(saved[((4, 1, 1), False)], catalog)


def test_which_runs_resume_from_which_checkpoint(
    saved: dict[tuple[Any, bool], Path], tmp_path: Path
) -> None:
    mesh = saved[((2, 2, 1), False)]
    assert resumable.kind_of(mesh) == "mesh" and resumable.kind_of(tmp_path) is None
    (tmp_path / "checkpoint.json").write_text('{"format": 1}')  # a --zero run's: the header
    assert resumable.kind_of(tmp_path) == "sharded"  # names it, not a checkpoint.pt
    assert resumable.committed(tmp_path) == tmp_path / "checkpoint.json"
    assert resumable.committed(mesh) == mesh / "checkpoint.json"
    resumable.check(mesh, on_mesh=False, zero=3)  # every run reads every kind
    with pytest.raises(CheckpointError, match="is a mesh checkpoint"):
        from plait.sharded.checkpoint import read_manifest

        read_manifest(mesh)


def dcp_save(folder: Path, state: dict[str, Any]) -> None:
    from torch.distributed import checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("keyed", ["index", "name"])
def test_a_dcp_directory_resumes_a_plain_run(tmp_path: Path, keyed: str) -> None:
    model, optimizer = trained()
    saved = optimizer.state_dict()
    if keyed == "name":  # as DCP's get_optimizer_state_dict keys it; the model at the top
        names = [n for n, _ in model.named_parameters()]
        state = {
            **model.state_dict(),
            "optimizer": {"state": {names[i]: s for i, s in saved["state"].items()}},
        }
    else:
        state = {"model": model.state_dict(), "optimizer": saved, "step": 5}
    dcp_save(tmp_path, state)
    assert resumable.kind_of(tmp_path) == "dcp"
    fresh = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    got = plain_state(tmp_path, fresh, fresh_optimizer)
    fresh.load_state_dict(got["model"])
    fresh_optimizer.load_state_dict(got["optimizer"])
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for i, s in saved["state"].items():
        for k, v in s.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][i][k], v), (i, k)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.5  # this run's hyperparameters
    assert got["step"] == (5 if keyed == "index" else 0) and got["losses"] == []


def test_a_dcp_directory_of_another_model_is_refused(tmp_path: Path) -> None:
    dcp_save(tmp_path, {"model": {"0.weight": torch.zeros(4, 3)}})
    model = nn.Sequential(nn.Linear(3, 4))
    where = tmp_path / ".metadata"
    with pytest.raises(CheckpointError, match=rf"{where} holds no tensor 'model.0.bias' for"):
        open_source(tmp_path, catalog_of(model))
    want = r"holds 'model.0.weight' of shape \(4, 3\); this model's '0.weight' is \(4, 5\)"
    with pytest.raises(CheckpointError, match=want):
        open_source(tmp_path, catalog_of(nn.Sequential(nn.Linear(5, 4, bias=False))))
    (tmp_path / "__0_0.distcp").unlink()  # DCP records no sizes: found as it reads
    source = open_source(tmp_path, catalog_of(nn.Sequential(nn.Linear(3, 4, bias=False))))
    with pytest.raises(CheckpointError, match=rf"cannot load the DCP checkpoint {where}: FileNotF"):
        source.tensor("0.weight")


def test_a_sharded_checkpoint_reads_back_whole_for_any_run(tmp_path: Path) -> None:
    """A --zero run's checkpoint (3 ranks) as a Source: what a mesh or plain run, or a
    --zero run at another stage of the pipeline, cuts its part from."""
    from support.sharded_states import STEP as ADAM_STEP
    from support.sharded_states import Model, save_all

    model = Model()
    save_all(tmp_path, model, 3)
    catalog = [(e.name, e.shape, u.dtype) for u in model.layout.units for e in u.entries]
    source = open_source(tmp_path, catalog)
    for u, unit in enumerate(model.layout.units):
        for e in unit.entries:
            assert torch.equal(source.tensor(e.name), model.params[e.name])
            state = source.optim(e.name)
            exp_avg = model.moments[u][0][e.offset : e.offset + e.numel].view(e.shape)
            assert torch.equal(state["exp_avg"], exp_avg) and torch.equal(state["step"], ADAM_STEP)
    assert source.buffers().keys() == model.buffers.keys()
    assert source.common()["step"] == 12 and "buffers" not in source.common()

"""A parameter-server job's checkpoint (plait/ps/run_checkpoint.py) in one process: servers
driven message by message (server.py is a socket-free state machine) save their keys, the
manifest commits them, and servers of another count resume from them; consolidated, they
are one plain state_dict. A missing, truncated, altered or foreign file is named, and a
server that cannot resume loads nothing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.cli import checkpoint as cli
from plait.errors import CheckpointError
from plait.ps import run_checkpoint
from plait.ps.config import PSConfig
from plait.ps.run_files import MANIFEST, common_file, server_file
from plait.ps.server import Server
from plait.ps.sharding import ParamSpec, gather, make_plan, specs_to_json
from plait.ps.wire import Message

# w is cut into two slices of 20 floats (slice_mb: 104 bytes), b packed with c; d is float64
SPECS = [ParamSpec("w", (5, 8), torch.float32), ParamSpec("b", (3,), torch.float32),
         ParamSpec("c", (2, 2), torch.float32), ParamSpec("d", (6,), torch.float64)]  # fmt: skip
SLICE_MB = 0.0001
STEP = 3


def _cfg(out: Path, **options: Any) -> PSConfig:
    return PSConfig(mode="async", optimizer="adam", lr=0.1, slice_mb=SLICE_MB,
                    run_dir=str(out), **options)  # fmt: skip


def _full() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s.shape, generator=g).to(s.dtype) for s in SPECS]


def _servers(cfg: PSConfig, count: int, values: list[torch.Tensor]) -> list[Server]:
    """`count` servers after worker 0's init of `values`."""
    plan = make_plan(SPECS, count, cfg.slice_bytes)
    servers = []
    for i in range(count):
        server = Server(i, 2, count, lambda: (cfg, specs_to_json(SPECS)))
        keys = plan.keys_of(i)
        init = Message("init", 1, 0, [k.key for k in keys], [gather(plan, k, values) for k in keys])
        ((_, reply),) = server.handle("w0", init, 0.0)
        assert reply.op == "ok", reply.meta
        servers.append(server)
    return servers


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[Server]]:
    """Two servers after two async pushes of each worker, saved as generation 1 of step 3."""
    out = tmp_path / "run"
    servers = _servers(_cfg(out), 2, _full())
    plan = make_plan(SPECS, 2, _cfg(out).slice_bytes)
    for clock in (1, 2):
        for w in (0, 1):
            grads = [torch.full(s.shape, 0.1 * (w + clock), dtype=s.dtype) for s in SPECS]
            for i, server in enumerate(servers):
                keys = plan.keys_of(i)
                push = Message("push", 10 * clock + w, w, [k.key for k in keys],
                               [gather(plan, k, grads) for k in keys], clock=clock)  # fmt: skip
                server.handle(f"w{w}", push, 0.1)
    for server in servers:
        meta = {"generation": 1, "step": STEP}
        ((_, reply),) = server.handle("w0", Message("save", 50, 0, meta=meta), 0.2)
        assert reply.op == "ok", reply.meta
    run_checkpoint.write_summed(out / common_file(1), {"step": STEP, "buffers": {}})
    run_checkpoint.commit(out, 1, STEP, plan)
    return out, servers


def _model_of(servers: list[Server]) -> dict[int, tuple[torch.Tensor, dict[str, Any], int]]:
    """Every key's value, optimizer state and version over `servers`."""
    assert all(s.cons is not None for s in servers)
    return {k: (s.values[k], s.opt[k].state(), s.cons.version[k])  # type: ignore[union-attr]
            for s in servers for k in s.keys}  # fmt: skip


@pytest.mark.parametrize("count", [1, 3])
def test_servers_of_another_count_resume_every_key_exactly(
    saved: tuple[Path, list[Server]], count: int
) -> None:
    out, old = saved
    new = _servers(_cfg(out, resume_run=True), count, [torch.zeros(s.shape, dtype=s.dtype)
                                                        for s in SPECS])  # fmt: skip
    want, got = _model_of(old), _model_of(new)
    assert sorted(got) == sorted(want) and len(want) == 4  # 2 slices of w, (b, c), d
    for k, (value, opt, version) in want.items():
        assert torch.equal(got[k][0], value) and got[k][2] == version == 4
        assert opt.keys() == got[k][1].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(opt[n], got[k][1][n]) for n in opt)
    for server in new:  # every worker's clock, and the last closed round, at the step
        assert server.cons is not None
        assert server.cons.clock == [STEP, STEP] and server.cons.closed_clock == STEP


def test_consolidate_gives_each_parameter_in_its_shape(
    saved: tuple[Path, list[Server]], tmp_path: Path
) -> None:
    out, old = saved
    state = run_checkpoint.consolidate(out)
    assert list(state) == [s.name for s in SPECS]
    plan = make_plan(SPECS, 2, _cfg(out).slice_bytes)
    values = _model_of(old)
    for k in plan.keys:  # each key of the state_dict is the server's value, in its place
        assert torch.equal(gather(plan, k, [state[s.name] for s in SPECS]), values[k.key][0])
    # the command: one file torch reads without plait
    args = argparse.Namespace(directory=str(out), output=str(tmp_path / "model.pt"))
    assert cli.consolidate(args) == 0
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    assert loaded["w"].shape == (5, 8) and loaded["d"].dtype == torch.float64


def test_a_second_save_commits_a_new_generation_and_prunes_the_old(
    saved: tuple[Path, list[Server]],
) -> None:
    out, servers = saved
    for server in servers:
        server.handle("w0", Message("save", 60, 0, meta={"generation": 2, "step": 4}), 0.3)
    run_checkpoint.write_summed(out / common_file(2), {"step": 4})
    run_checkpoint.commit(out, 2, 4, make_plan(SPECS, 2, _cfg(out).slice_bytes))
    assert run_checkpoint.read_manifest(out).generation == run_checkpoint.next_generation(out) - 1
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, *(f"{n}{s}" for n in (server_file(2, 0, 2), server_file(2, 1, 2),
                                          common_file(2)) for s in ("", ".sum"))]
    )  # fmt: skip


def test_a_bad_file_is_named_and_nothing_is_loaded(
    saved: tuple[Path, list[Server]],
) -> None:
    out, _ = saved
    m = run_checkpoint.read_manifest(out)
    one = out / server_file(1, 1, 2)
    data = one.read_bytes()
    one.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=f"{one} has 100 bytes; .* the file is truncated"):
        run_checkpoint.check_files(m)
    one.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{one} is corrupt: its sha256"):
        run_checkpoint.check_files(m)
    one.unlink()
    with pytest.raises(CheckpointError, match=f"names {one}, which is missing"):
        run_checkpoint.check_files(m)
    # a server resuming from it answers worker 0's init with the reason and stays unconfigured
    cfg = _cfg(out, resume_run=True)
    server = Server(1, 2, 2, lambda: (cfg, specs_to_json(SPECS)))
    ((_, reply),) = server.handle("w0", Message("init", 1, 0), 0.0)
    assert reply.op == "error" and "which is missing" in reply.meta["reason"]
    assert server.cons is None and server.values == {}


def test_another_model_or_slice_size_is_refused(saved: tuple[Path, list[Server]]) -> None:
    out, _ = saved
    m = run_checkpoint.read_manifest(out)
    other = [ParamSpec("w", (5, 9), torch.float32), *SPECS[1:]]
    with pytest.raises(CheckpointError, match=r"parameter 0 as w torch.float32 \[5, 8\]; this"):
        run_checkpoint.check_plan(m, make_plan(other, 2, 104))
    with pytest.raises(CheckpointError, match=r"slices of 104 bytes; .* 4194304 bytes"):
        run_checkpoint.check_plan(m, make_plan(SPECS, 2, 4 << 20))
    run_checkpoint.check_plan(m, make_plan(SPECS, 5, 104))  # another count of servers: fine
    (out / MANIFEST).write_text(json.dumps({"format": 1, "generation": 1}))
    with pytest.raises(CheckpointError, match="is not a parameter-server checkpoint"):
        run_checkpoint.read_manifest(out)


def test_save_comes_from_worker_0_of_a_job_with_a_run_dir(tmp_path: Path) -> None:
    server = _servers(PSConfig(mode="async"), 1, _full())[0]
    meta = {"generation": 1, "step": 1}
    ((_, reply),) = server.handle("w0", Message("save", 5, 0, meta=meta), 0.1)
    assert reply.op == "error" and "PSConfig(run_dir=...)" in reply.meta["reason"]
    server = _servers(_cfg(tmp_path), 1, _full())[0]
    ((_, reply),) = server.handle("w1", Message("save", 5, 1, meta=meta), 0.1)
    assert reply.op == "error" and "from worker 0" in reply.meta["reason"]


def test_a_resumed_header_names_the_servers_manifest(tmp_path: Path) -> None:
    """`plait train --strategy ps --resume` says "resumed from DIR/ps-checkpoint.json", the
    file that commits a ps checkpoint, not a checkpoint.pt that is not there."""
    from plait.train.resumable import committed

    (tmp_path / MANIFEST).write_text("{}")
    assert committed(tmp_path) == tmp_path / MANIFEST

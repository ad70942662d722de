"""`MeshForward`: inference on a dp x pp x tp mesh against the single-process forward.

The backbone: each rank builds the model from a seed and computes the plain model's output
on its dp group's batches itself; the mesh's last stage must return the same (float64,
tight tolerance), for gpt and an MLP, on dp 2 x pp 2, dp 2 x tp 2 and pp 2 x tp 2. The dp
groups run different batches, and different numbers of them (a collective over dp would
hang), with sizes not divisible by chunks, smaller than chunks, and of one sample. Also the
structure of the communication (per batch, min(chunks, size) activations per stage
boundary forward, none backward, tags apart between batches), that the micro-batches
overlap (stage 0's last micro-batch waits for stage 1 to have computed its first, and the
trace's recorded times agree: every rank of one host reads one clock), and the errors.

One world of 4 ranks runs every check once (`battery`).
"""

from __future__ import annotations

import copy
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator
from plait.comm.mesh import Mesh
from plait.infer.mesh import MeshForward
from plait.trace.recorder import Recorder
from plait.train import workloads
from plait.train.gpt import GPT, GPTConfig
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "60"}
f64 = torch.float64
CHUNKS = 3
# each dp group's batch sizes: not divisible by chunks, fewer than chunks, one; the groups
# run different counts of batches
SIZES = {0: [7, 2, 1], 1: [5, 1, 3, 2]}
SHAPES = [{"dp": 2, "pp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}]


def _mlp() -> nn.Sequential:
    """An MLP whose hidden layer's linears are named fc/proj, so tp can split it."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(6, 8), nn.Linear(8, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), Block(), nn.Tanh(), Block(), nn.Linear(6, 3)).to(f64)


def _gpt_work() -> Any:
    return workloads.build("gpt", 8, data="synthetic", seed=0)


def _inputs(name: str, dp: int, batch: int, size: int) -> torch.Tensor:
    """Batch `batch` of dp group `dp`: its own samples."""
    if name == "gpt":
        x, _ = _gpt_work().batch(dp * 10 + batch)
        return x[:size]  # type: ignore[no-any-return]
    g = torch.Generator().manual_seed(100 * dp + batch)
    return torch.randn(size, 5, generator=g, dtype=f64)


def _model(name: str) -> nn.Module:
    return _gpt_work().model().to(f64) if name == "gpt" else _mlp()


def _equivalence(mesh: Mesh, name: str) -> dict[str, Any]:
    """Every batch of this rank's dp group: the largest difference from the plain model
    (None where the rank returns None, as it must off the last stage)."""
    model = _model(name)
    ref = copy.deepcopy(model).eval()
    fw = MeshForward(model, mesh, chunks=CHUNKS)
    dp = mesh.coords["dp"]
    errors: list[float | None] = []
    for b, size in enumerate(SIZES[dp]):
        x = _inputs(name, dp, b, size)
        with torch.no_grad():
            want = ref(x)
        out = fw(x if fw.first else None, size)
        if out is None:
            errors.append(None)
            continue
        assert out.shape == want.shape, (out.shape, want.shape)
        assert not out.requires_grad
        errors.append(float((out - want).abs().max()))
    training = any(m.training for m in fw.stage.modules())
    return {"errors": errors, "first": fw.first, "last": fw.last, "writes": fw.writes,
            "coords": dict(mesh.coords), "training": training}  # fmt: skip


def _structure(mesh: Mesh) -> dict[str, Any]:
    """The pp communicator's sends and receives per batch (dp 2 x pp 2, sizes 5 then 2)."""
    fw = MeshForward(_mlp(), mesh, chunks=CHUNKS)
    log: list[tuple[str, int, int, bool]] = []
    pp = mesh.pp
    isend, recv = pp.isend, pp.recv

    class Logged:  # a send's request, whose wait is logged
        def __init__(self, req: Any, peer: int, tag: int, ordered: bool) -> None:
            self.req, self.what = req, (peer, tag, ordered)

        def wait(self) -> Any:
            log.append(("wait", *self.what))
            return self.req.wait()

    def counted_isend(t: torch.Tensor, peer: int, tag: int = 0, *, ordered: bool = False) -> Any:
        log.append(("isend", peer, tag, ordered))
        return Logged(isend(t, peer, tag, ordered=ordered), peer, tag, ordered)

    def counted_recv(t: torch.Tensor, peer: int, tag: int = 0, *, ordered: bool = False) -> Any:
        log.append(("recv", peer, tag, ordered))
        return recv(t, peer, tag, ordered=ordered)

    pp.isend, pp.recv = counted_isend, counted_recv  # type: ignore[method-assign]
    per_batch = []
    for b, size in enumerate([5, 2, 4]):
        before = len(log)
        x = _inputs("mlp", mesh.coords["dp"], b, size)
        fw(x if fw.first else None, size)
        per_batch.append(log[before:])
    pp.isend, pp.recv = isend, recv  # type: ignore[method-assign]
    return {"stage": mesh.coords["pp"], "per_batch": per_batch}


class Mark(nn.Module):
    """Identity that, the first time it runs, creates the file `path`."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.path.touch()
        return x


class Gate(nn.Module):
    """Identity that, on its `at`-th call, waits (at most 20 s) for the file `path`: stage 0
    computes its last micro-batch only once stage 1 has computed micro-batch 0. A pipeline
    that did not overlap them would wait out the 20 s, and `seen` says so: the order is
    caused, not raced."""

    def __init__(self, path: Path, at: int) -> None:
        super().__init__()
        self.path, self.at, self.calls, self.seen = path, at, 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            deadline = time.monotonic() + 20
            while not self.path.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.seen = self.path.exists()
        return x


def _overlap(mesh: Mesh, where: Path) -> dict[str, Any]:
    """One batch of 4 micro-batches on dp 2 x pp 2, recorded; stage 0 holds its last
    micro-batch until stage 1 has computed micro-batch 0 (or 20 s have passed)."""
    torch.manual_seed(0)
    marker = where / f"dp{mesh.coords['dp']}"
    gate = Gate(marker, at=4)
    model = nn.Sequential(nn.Linear(5, 5), gate, Mark(marker), nn.Linear(5, 3))
    fw = MeshForward(model, mesh, chunks=4)
    recorder = mesh.pp.recorder = Recorder(mesh.comm.rank)
    x = torch.randn(8, 5)
    fw(x if fw.first else None, 8)
    mesh.pp.recorder = None
    return {"stage": mesh.coords["pp"], "dp": mesh.coords["dp"], "seen": gate.seen,
            "events": [(e[0], e[1], e[2], e[3]) for e in recorder.events]}  # fmt: skip


def _raises(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _errors(comm: Communicator) -> dict[str, str | None]:
    """Each error, raised on this rank alone before any message (so no peer waits)."""
    out: dict[str, str | None] = {}
    pp = Mesh(dp=2, pp=2, comm=comm)
    fw = MeshForward(_mlp(), pp, chunks=2)
    x = torch.randn(4, 5, dtype=f64)
    out["size 0"] = _raises(lambda: fw(x[:0] if fw.first else None, 0))
    if fw.first:
        out["x missing"] = _raises(lambda: fw(None, 4))
        out["x short"] = _raises(lambda: fw(x[:3], 4))
    else:
        out["x given"] = _raises(lambda: fw(x, 4))
    out["chunks 0"] = _raises(lambda: MeshForward(_mlp(), pp, chunks=0))

    class Opaque(nn.Module):  # neither an nn.Sequential nor a layers() method
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    out["no stages"] = _raises(lambda: MeshForward(Opaque(), pp, chunks=2))
    out["too few layers"] = _raises(lambda: MeshForward(nn.Sequential(nn.Linear(5, 3)), pp,
                                                        chunks=2))  # fmt: skip
    tp = Mesh(tp=4, comm=comm)
    small = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    out["heads"] = _raises(lambda: MeshForward(GPT(small), tp, chunks=2))
    out["no tp layers"] = _raises(lambda: MeshForward(nn.Sequential(nn.Linear(5, 3)), tp,
                                                      chunks=2))  # fmt: skip
    return out


def battery(comm: Communicator, where: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for i, shape in enumerate(SHAPES):
        mesh = Mesh(**shape, comm=comm)
        for name in ("mlp", "gpt"):
            found[f"{name} {i}"] = _equivalence(mesh, name)
        if i == 0:
            found["structure"] = _structure(mesh)
            found["overlap"] = _overlap(mesh, where)
    found["errors"] = _errors(comm)
    return found


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    start = time.monotonic()
    found = run_world(4, battery, tmp_path_factory.mktemp("marks"), timeout=120, env=ENV)
    print(f"world of 4 ran every check in {time.monotonic() - start:.1f} s")
    return found


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_outputs_equal_the_single_process_forward(
    four_ranks: list[dict[str, Any]], name: str, index: int
) -> None:
    for rank, found in enumerate(four_ranks):
        got = found[f"{name} {index}"]
        dp, pp, tp = (got["coords"][a] for a in ("dp", "pp", "tp"))
        stages = SHAPES[index].get("pp", 1)
        assert got["first"] == (pp == 0) and got["last"] == (pp == stages - 1)
        assert got["writes"] == (got["last"] and tp == 0)
        assert not got["training"], "the stage must be in eval mode"
        assert len(got["errors"]) == len(SIZES[dp]), "each dp group runs its own batches"
        for size, err in zip(SIZES[dp], got["errors"], strict=True):
            if not got["last"]:
                assert err is None, f"rank {rank} is no last stage but returned an output"
                continue
            # every tp rank of the last stage holds the whole output
            assert err is not None and err < 1e-10, f"rank {rank}, {SHAPES[index]}, size {size}"


def test_each_stage_boundary_carries_one_message_per_micro_batch_forward_only(
    four_ranks: list[dict[str, Any]],
) -> None:
    sizes = [5, 2, 4]
    for found in four_ranks:
        got = found["structure"]
        tags_by_batch = []
        for size, log in zip(sizes, got["per_batch"], strict=True):
            n = min(CHUNKS, size)
            if got["stage"] == 0:  # sends only, to stage 1: a header and a payload each,
                # all posted before any is waited for (no micro-batch waits on a send)
                assert [op for op, *_ in log] == ["isend"] * 2 * n + ["wait"] * 2 * n
                assert {peer for _, peer, _, _ in log} == {1}
                assert sum(ordered for op, *_, ordered in log if op == "isend") == n
                tags_by_batch.append({tag for _, _, tag, _ in log})
            else:  # receives only, from stage 0; nothing goes back
                assert [op for op, *_ in log] == ["recv"] * 2 * n
                assert {peer for _, peer, _, _ in log} == {0}
            assert len({tag for _, _, tag, _ in log}) == n  # one per micro-batch
        for tags in tags_by_batch:  # clear of the training pipeline's (kind, part, mb) tags
            assert not tags & set(range(2 * CHUNKS))
        for a, b in itertools.pairwise(tags_by_batch):
            assert not a & b, "consecutive batches must not share tags"


def _spans(found: dict[str, Any], cat: str, name: str) -> tuple[float, float]:
    [(start, end)] = [(e[2], e[3]) for e in found["events"] if e[0] == cat and e[1] == name]
    return start, end


def _pair(four_ranks: list[dict[str, Any]], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    stage = {(f[key]["dp"], f[key]["stage"]): f[key] for f in four_ranks}
    return stage[(0, 0)], stage[(0, 1)]


def test_micro_batches_overlap_across_stages(four_ranks: list[dict[str, Any]]) -> None:
    first, second = _pair(four_ranks, "overlap")
    # stage 0's last micro-batch waited for stage 1's first: they overlap, or this is False
    assert first["seen"], "stage 1 did not compute micro-batch 0 while stage 0 still worked"
    got_mb0 = next(e for e in second["events"] if e[0] == "comm" and e[1] == "recv")[3]
    # the same, on the recorded times (one clock for the ranks of one host)
    assert got_mb0 < _spans(first, "pipeline", "F3")[1]
    for mb in range(4):  # each micro-batch is sent on after its compute on stage 0
        assert _spans(first, "pipeline", f"F{mb}")[1] <= _spans(second, "pipeline", f"F{mb}")[0]


EXPECTED = {
    "size 0": "size must be an integer >= 1",
    "x missing": "stage 0 takes the inputs",
    "x short": "x has 3 samples, but size is 4",
    "x given": "only pipeline stage 0 takes inputs; this rank is stage 1",
    "chunks 0": "chunks must be an integer in [1, 1073741824]; got 0",
    "no stages": "Opaque cannot be laid on pp 2 x tp 1: a pipeline (--pp) cuts the model",
    "too few layers": "cannot split 1 layers into 2",
    "heads": "n_head 2 % tp 4 = 2 != 0",
    "no tp layers": "parallelize found no attention",
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_errors_say_what_was_expected(four_ranks: list[dict[str, Any]], case: str) -> None:
    seen = [found["errors"][case] for found in four_ranks if case in found["errors"]]
    assert seen, case
    for message in seen:
        assert message is not None and EXPECTED[case] in message, message

"""plait train's --precision, --reduce-dtype, --activation-checkpointing and --compile.

One world of 2 ranks (tests/support/world.py) runs every in-process check once (`battery`):
each option's run next to the plain fp32 eager run it must stay close to (or equal:
activation checkpointing recomputes the same arithmetic), fp16's loss scaling forced to
overflow, and DataParallel's `reduce_dtype` on gradients chosen so the expected rounding is
known. The checks without a world (the loss scaler, the config's errors, the compiler
check) are in tests/unit/test_train_precision_checks.py; the real `plait train` command in
tests/e2e/test_train_precision_command.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait import Communicator
from plait.data_parallel import DataParallel
from plait.sharded import ShardedDataParallel
from plait.train import compile as compiling
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError
from plait.train.loop import train
from support.held_out import few_held_out_windows
from support.world import run_world

ENV = {"PLAIT_TIMEOUT": "120"}
MLP = {"model": "mlp", "steps": 12, "batch_size": 24, "eval_every": 6}
# 3 steps, one held-out pass (which costs more than the steps): the optimizer's state matters
# from the second step on
GPT = {"model": "gpt", "data": "synthetic", "steps": 3, "batch_size": 4, "eval_every": 3}
OVERFLOW = 2.0**60  # fp16: every gradient overflows, whatever halving 12 steps bring
SOME_OVERFLOW = 2.0**24  # fp16: the first steps overflow, until the scale has come down
try:
    compiling.check("cpu")
    NO_COMPILER = ""
except ConfigError as e:
    NO_COMPILER = str(e)


class Dot(nn.Module):
    """(w * x).sum(): backward leaves x as w's gradient, so a test chooses the gradient."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _gradients(rank: int, n: int = 4096) -> torch.Tensor:
    """Rank `rank`'s chosen gradient: values whose bf16 halves round (seeded by rank)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))


def _reduce_dtype(comm: Communicator) -> dict[str, Any]:
    """DataParallel(reduce_dtype=...) on chosen gradients: the average each rank gets."""
    results: dict[str, Any] = {}
    for name, dtype, big in (("bf16", torch.bfloat16, 0.0), ("fp16", torch.float16, 6e4)):
        dp = DataParallel(Dot(4096), comm=comm, reduce_dtype=dtype)
        # fp16: 6e4 + 6e4 overflows its largest value, 65504; the average does not
        dp(_gradients(comm.rank) + big).backward()
        grad = dp.module.w.grad
        # as a list: a tensor crosses to the parent through a file descriptor the parent
        # fetches from this process, which may have exited by then (the result then lost)
        results[name] = (grad.tolist(), dp.bucket_sizes, str(grad.dtype))
    for stage in (1, 3):  # ZeRO's reduce-scatter in bf16: each rank's part of that average
        sdp = ShardedDataParallel(Dot(4096), stage=stage, comm=comm, reduce_dtype=torch.bfloat16)
        sdp(_gradients(comm.rank)).backward()
        results[f"zero{stage}"] = (sdp.shards[0].grad.tolist(), str(sdp.shards[0].grad.dtype))
    return results


def _train(
    comm: Communicator, options: dict[str, Any], stop_after: int | None = None
) -> dict[str, Any]:
    config = TrainConfig.from_options({**options, "workers": comm.size})
    figures: dict[str, Any] = train(config, comm, stop_after=stop_after).figures()
    return figures


def _resumed(comm: Communicator, options: dict[str, Any], out: str) -> dict[str, Any]:
    """A run stopped after step 5 (checkpoint at 3), then resumed to the end."""
    cut = {**options, "out": out, "checkpoint_every": 3}
    _train(comm, cut, stop_after=5)
    comm.barrier()  # rank 0's checkpoint is on disk before anyone resumes
    return _train(comm, {**cut, "resume": True})


def battery(comm: Communicator, tmp: str) -> dict[str, Any]:
    few_held_out_windows()  # support/held_out.py: the evaluation at each run's end
    runs: dict[str, Any] = {"reduce_dtype": _reduce_dtype(comm)}
    cases: dict[str, dict[str, Any]] = {
        "mlp": MLP,
        "mlp bf16": {**MLP, "precision": "bf16"},
        "mlp fp16": {**MLP, "precision": "fp16"},
        "mlp fp16 overflow": {**MLP, "precision": "fp16", "loss_scale": OVERFLOW},
        "mlp fp16 some overflow": {**MLP, "precision": "fp16", "loss_scale": SOME_OVERFLOW},
        "mlp reduce bf16": {**MLP, "reduce_dtype": "bf16"},
        "gpt": GPT,
        "gpt ckpt": {**GPT, "activation_checkpointing": True},
        "gpt pp2": {**GPT, "pp": 2},
        "gpt pp2 ckpt fp16": {**GPT, "pp": 2, "activation_checkpointing": True,
                              "precision": "fp16"},
    }  # fmt: skip
    if not NO_COMPILER:
        cases["mlp compile"] = {**MLP, "compile": True}
        # ZeRO: each unit (mlp's Linear layers) compiled inside the hooks that gather it
        cases["mlp zero3 compile"] = {**MLP, "zero": 3, "compile": True}
        # each stage compiled, cut at its layers for zb-h1's split backward
        cases["mlp pp2 compile bf16"] = {**MLP, "pp": 2, "compile": True, "precision": "bf16",
                                         "schedule": "zb-h1"}  # fmt: skip
    some = cases["mlp fp16 some overflow"]
    runs["resumed fp16"] = _resumed(comm, some, f"{tmp}/fp16")
    graphs = torch._dynamo.utils.counters["aot_autograd"]  # what torch.compile made
    for name, options in cases.items():
        before = graphs["total"]
        runs[name] = {**_train(comm, options), "graphs": graphs["total"] - before}
    return runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("precision")
    return run_world(2, battery, str(tmp), timeout=600, env=ENV)


def _close(a: list[float], b: list[float], tol: float) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=tol)


@pytest.mark.timeout(700)
def test_low_precision_losses_stay_close_to_fp32(two_ranks: list[dict[str, Any]]) -> None:
    runs = two_ranks[0]
    fp32 = runs["mlp"]["losses"]
    assert fp32[-1] < fp32[0] - 0.2  # it trains: the comparison means something
    for name in ("mlp bf16", "mlp fp16", "mlp reduce bf16"):
        run = runs[name]
        assert run["losses"] != fp32, name  # the low precision did round something
        _close(run["losses"], fp32, 0.01)
    assert runs["mlp bf16"]["precision"] == "bf16" and runs["mlp bf16"]["loss_scale"] is None
    assert runs["mlp fp16"]["skipped_steps"] == 0 and runs["mlp fp16"]["loss_scale"] == 2.0**16
    # bf16 gradients on the wire: half the bytes of the fp32 run's
    assert runs["mlp reduce bf16"]["allreduce_bytes"] * 2 == runs["mlp"]["allreduce_bytes"]


@pytest.mark.timeout(700)
def test_fp16_overflow_skips_the_step_and_halves_the_scale(
    two_ranks: list[dict[str, Any]],
) -> None:
    never = two_ranks[0]["mlp fp16 overflow"]
    assert never["skipped_steps"] == 12 and never["loss_scale"] == OVERFLOW / 2**12
    some = two_ranks[0]["mlp fp16 some overflow"]
    k = some["skipped_steps"]
    assert 0 < k < 12 and some["loss_scale"] == SOME_OVERFLOW / 2**k
    # skipped steps leave the model as it was: until the first step taken, its losses are
    # those of the run that never steps; after it they are not
    assert some["losses"][: k + 1] == never["losses"][: k + 1]
    assert some["losses"][k + 1] != never["losses"][k + 1]
    assert [r["mlp fp16 some overflow"]["skipped_steps"] for r in two_ranks] == [k, k]
    # a checkpoint keeps the scale (and the count): resumed, the run repeats itself
    resumed = two_ranks[0]["resumed fp16"]
    assert resumed["losses"] == some["losses"]
    assert (resumed["loss_scale"], resumed["skipped_steps"]) == (some["loss_scale"], k)


@pytest.mark.timeout(700)
def test_activation_checkpointing_same_losses_fewer_bytes(
    two_ranks: list[dict[str, Any]],
) -> None:
    runs = two_ranks[0]
    plain, ckpt = runs["gpt"], runs["gpt ckpt"]
    assert ckpt["losses"] == plain["losses"]  # the same arithmetic, run again in backward
    assert ckpt["checkpointed_blocks"] == [f"blocks.{i}" for i in range(4)]
    assert plain["checkpointed_blocks"] == []
    # the blocks' inputs, and one block's activations again while backward recomputes it
    # (counted since plait.saved_tensors): 4 blocks of gpt's 6 layers, 28% of the plain peak
    assert ckpt["activation_bytes"] < plain["activation_bytes"] / 3
    # the pipeline's stages: the blocks checkpointed before the model is cut, fp16 agreed on
    # by both stages; the losses those of the one-process run, up to fp16's rounding
    pp = runs["gpt pp2 ckpt fp16"]
    assert pp["checkpointed_blocks"] == ckpt["checkpointed_blocks"]
    _close(runs["gpt pp2"]["losses"], plain["losses"], 1e-4)
    _close(pp["losses"], plain["losses"], 0.02)
    assert [r["gpt pp2 ckpt fp16"]["loss_scale"] for r in two_ranks] == [2.0**16] * 2


@pytest.mark.timeout(700)
@pytest.mark.skipif(bool(NO_COMPILER), reason=f"torch.compile cannot build: {NO_COMPILER}")
def test_compiled_losses_match_eager(two_ranks: list[dict[str, Any]]) -> None:
    runs = two_ranks[0]
    eager = runs["mlp"]
    compiled = runs["mlp compile"]
    _close(compiled["losses"], eager["losses"], 1e-4)
    assert compiled["compile_s"] > 0 and eager["compile_s"] is None
    _close(runs["mlp zero3 compile"]["losses"], eager["losses"], 1e-4)
    # graphs were made (not a silent fall back to eager), on every rank: the first stage's
    # holds only nn.Flatten and nn.Linear, torch's own modules
    assert eager["graphs"] == 0
    assert all(
        r[name]["graphs"] >= 1
        for r in two_ranks
        for name in ("mlp compile", "mlp zero3 compile", "mlp pp2 compile bf16")
    )
    staged = runs["mlp pp2 compile bf16"]  # each pipeline stage compiled, under autocast
    _close(staged["losses"], runs["mlp bf16"]["losses"], 0.01)


@pytest.mark.timeout(700)
def test_reduce_dtype_averages_in_the_low_precision(two_ranks: list[dict[str, Any]]) -> None:
    g0, g1 = _gradients(0), _gradients(1)
    # each term divided by the world size and rounded to bf16, then their sum rounded
    expected = ((g0 / 2).bfloat16() + (g1 / 2).bfloat16()).float()
    for rank in two_ranks:
        values, sizes, dtype = rank["reduce_dtype"]["bf16"]
        grad = torch.tensor(values)  # float32, exactly: each value is one
        assert dtype == "torch.float32"  # back in the parameter's dtype
        assert torch.equal(grad, expected)
        assert not torch.equal(grad, (g0 + g1) / 2)  # the rounding is there to see
        assert sizes == [4096 * 2]  # bf16 bytes in the bucket
        big = torch.tensor(rank["reduce_dtype"]["fp16"][0])
        assert torch.isfinite(big).all()  # divided before the cast: no overflow
        torch.testing.assert_close(big, (g0 + g1) / 2 + 6e4, rtol=1e-3, atol=0)
    # --zero: the same rounding, each rank's half of it (stage 1 keeps it in its fp32 buffer)
    for r, rank in enumerate(two_ranks):
        for stage in (1, 3):
            values, dtype = rank["reduce_dtype"][f"zero{stage}"]
            assert dtype == "torch.float32"
            assert torch.equal(torch.tensor(values), expected[r * 2048 : (r + 1) * 2048])

"""TrainConfig checks, the dataclass -> argparse derivation, and the LR schedule (the command
line's answers to bad input are in tests/e2e/test_train_config_command.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from plait.options import add_options, build, flatten, from_args, group, option
from plait.ps.config import PSConfig
from plait.train import job
from plait.train.config import RECIPES, OptimConfig, TrainConfig, WorkloadConfig
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError
from plait.train.lr_schedule import lr_at


# --------------------------------------------------------------------------- config
def _config(**options: object) -> TrainConfig:
    return TrainConfig.from_options(options)


def test_defaults_come_from_the_model_recipe() -> None:
    c = TrainConfig()
    w = c.workload
    assert (w.model, w.data, c.workers, c.strategy) == ("mlp", "digits", 4, "allreduce")
    assert (c.steps, c.batch_size, c.optim.lr) == (RECIPES["mlp"].steps, 64, RECIPES["mlp"].lr)
    g = TrainConfig(workload=WorkloadConfig(model="gpt"))
    assert g.workload.data == "code" and g.steps == RECIPES["gpt"].steps
    assert g.optim.warmup_steps == 36  # the recipe says 40, but at most 360 steps / 10
    assert _config(model="gpt", steps=7, lr=0.5).optim.lr == 0.5
    assert _config(model="gpt", steps=7).optim.warmup_steps == 0  # at most steps / 10
    assert (c.log.eval_every, c.log.log_every, c.checkpoint.checkpoint_every) == (120, 60, 120)


def test_options_land_in_their_components() -> None:
    c = _config(model="cnn", steps=9, dp=2, workers=2, out="/tmp/x", log_every=3)
    assert (c.workload.model, c.optim.steps, c.mesh.dp) == ("cnn", 9, 2)
    assert (c.checkpoint.out, c.log.log_every) == ("/tmp/x", 3)
    assert _config(**c.options()) == c  # the flat options rebuild the same config


def test_config_survives_a_json_round_trip() -> None:
    c = _config(model="cnn", data="synthetic", steps=9, out="/tmp/x", json="f.json")
    assert TrainConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    p = _config(strategy="ps", ps_mode="async", stale_policy="drop", staleness=2)
    assert TrainConfig.from_dict(json.loads(json.dumps(asdict(p)))) == p


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 30, "workers": 4}, "--batch-size 30 % --workers 4 = 2 != 0"),
        ({"batch_size": 2, "workers": 4}, "--batch-size 2 % --workers 4 = 2 != 0"),
        ({"model": "resnet"}, "model 'resnet' is not one of mlp, cnn, gpt"),
        ({"data": "imagenet"}, "data 'imagenet' is not one of digits, code, synthetic"),
        ({"model": "gpt", "data": "digits"}, "use --data code or synthetic"),
        ({"model": "mlp", "data": "code"}, "use --data digits or synthetic"),
        ({"workers": 0}, "workers 0 < 1"),
        ({"steps": 0}, "steps 0 < 1"),
        ({"lr": 0.0}, "lr 0.0 is not > 0"),
        ({"lr": float("nan")}, "lr nan is not > 0"),
        ({"steps": 10, "warmup_steps": 11}, "--warmup-steps 11 > --steps 10"),
        ({"resume": True}, "--resume needs --out DIR"),
        ({"strategy": "ps-async"}, "strategy 'ps-async' is not one of allreduce, ps"),
        ({"lr_scaling": "cubic"}, "--lr-scaling 'cubic' is not one of none, linear, sqrt"),
        ({"workload": "pkg.mod:make", "model": "cnn"}, "--model chooses a built-in workload"),
        ({"workload": "pkg.mod"}, "workload 'pkg.mod' is not MODULE:FUNCTION"),
        # nothing averages a gradient on a mesh of dp 1: the option would be ignored
        ({"workers": 2, "pp": 2, "reduce_dtype": "bf16"}, "--reduce-dtype bf16 changes nothing"),
        ({"workers": 2, "tp": 2, "model": "gpt", "compression": "topk:0.1"}, "at dp 1"),
    ],
)
def test_bad_options_show_the_failing_check(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**options)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # a default value given in vain is refused as any other (the config alone cannot tell)
        ({"strategy": "ps", "ps_mode": "sync", "staleness": 4},
         "--staleness applies to --ps-mode async or ssp, not --ps-mode sync"),
        ({"strategy": "ps", "stale_policy": "drop", "warm_start_steps": 2},
         "--stale-policy, --warm-start-steps apply to --ps-mode async or ssp"),
        ({"ps_mode": "sync"}, "--ps-mode applies to --strategy ps only, not --strategy allreduce"),
        ({"servers": 2, "staleness": 3}, "--servers, --staleness apply to --strategy ps only"),
    ],
)  # fmt: skip
def test_options_given_in_vain_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        job.configure(options)
    assert message in str(err.value)
    job.configure({"strategy": "ps", "ps_mode": "ssp", "staleness": 4})  # where they apply


def test_linear_scaling_uses_the_base_batch() -> None:
    base = RECIPES["mlp"].base_batch
    c = _config(batch_size=4 * base, lr=0.1, lr_scaling="linear")
    assert c.peak_lr == pytest.approx(0.4)
    assert _config(batch_size=4 * base, lr=0.1).peak_lr == 0.1
    # Goyal et al.: the warm-up starts from the unscaled rate
    w = _config(batch_size=4 * base, lr=0.1, lr_scaling="linear", warmup_steps=4, steps=40)
    assert w.lr_at(1) == pytest.approx(0.1 + (0.4 - 0.1) / 4)


def test_sqrt_scaling_is_the_layerwise_optimizers_default() -> None:
    base = RECIPES["mlp"].base_batch
    for name, scaling in (("sgd", "none"), ("adamw", "none"), ("lars", "sqrt"), ("lamb", "sqrt")):
        c = _config(optimizer=name, batch_size=4 * base, lr=0.1)
        assert c.optim.lr_scaling == scaling
        assert c.peak_lr == pytest.approx(0.2 if scaling == "sqrt" else 0.1)
    # at the base batch sqrt is the unscaled run, its warm-up from 0 included
    at_base = [_config(optimizer="lamb", lr_scaling=s, warmup_steps=4, steps=40) for s in
               ("none", "sqrt")]  # fmt: skip
    assert [c.lr_at(k) for k in (1, 5, 40) for c in at_base[:1]] == [
        c.lr_at(k) for k in (1, 5, 40) for c in at_base[1:]
    ]
    assert _config(optimizer="sgd", lr_scaling="sqrt", batch_size=base // 4).peak_lr == (
        pytest.approx(RECIPES["mlp"].rates["sgd"].lr / 2)
    )


def test_linear_scaling_of_lars_and_lamb_past_4x_is_warned_of() -> None:
    base = RECIPES["mlp"].base_batch
    c = _config(optimizer="lamb", batch_size=8 * base, lr=0.01, lr_scaling="linear")
    warning = c.rate_warning()
    assert warning is not None
    assert "peak lr of 0.08 (0.01 x 512/64)" in warning and "sqrt" in warning
    assert "gives 0.0283" in warning
    at_4x = _config(optimizer="lamb", batch_size=4 * base, lr_scaling="linear")
    assert at_4x.rate_warning() is None
    assert _config(optimizer="lamb", batch_size=8 * base).rate_warning() is None  # sqrt
    assert _config(batch_size=8 * base, lr_scaling="linear").rate_warning() is None  # sgd


def test_a_custom_workload_takes_the_generic_defaults() -> None:
    c = _config(workload="pkg.mod:make")
    assert (c.workload.model, c.workload.data, c.workload.path) == (None, None, "pkg.mod:make")
    assert c.recipe.optimizer == "sgd" and c.steps == c.recipe.steps


# ----------------------------------------------------------------- argparse helper
@dataclass(kw_only=True)
class Toy:
    name: str = field(default="a", metadata=option("a name", choices=("a", "b")))
    size: int | None = field(default=None, metadata=option("a size", default_text="auto"))
    rate: float = field(default=0.5, metadata=option("a rate"))
    fast: bool = field(default=False, metadata=option("go fast"))
    hidden: int = field(default=3, metadata=option("not on the CLI", cli=False))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_options(p, Toy)
    return p


def test_options_are_derived_from_the_fields() -> None:
    p = _parser()
    assert from_args(Toy, p.parse_args([])) == Toy()
    got = from_args(Toy, p.parse_args(["--name", "b", "--size", "7", "--rate", "2", "--fast"]))
    assert got == Toy(name="b", size=7, rate=2.0, fast=True)
    text = p.format_help()
    assert "--size SIZE" not in text and "--size INT" in text
    assert "a size (default: auto)" in text and "a rate (default: 0.5)" in text
    assert "--hidden" not in text


def test_derived_options_reject_bad_values() -> None:
    p = _parser()
    for argv in (["--name", "c"], ["--size", "x"], ["--rate", "fast"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_plait_train_parser_builds_the_config() -> None:
    from plait.cli.main import build_parser

    assert from_args(TrainConfig, build_parser().parse_args(["train"])) == TrainConfig()
    ns = build_parser().parse_args(["train", "--batch-size", "8", "--lr-scaling", "linear"])
    assert from_args(TrainConfig, ns) == TrainConfig(
        optim=OptimConfig(batch_size=8, lr_scaling="linear")
    )
    ns = build_parser().parse_args(["train", "--strategy", "ps", "--ps-mode", "ssp"])
    assert from_args(TrainConfig, ns).ps == TrainConfig(strategy="ps", ps=PSConfig(mode="ssp")).ps


@dataclass(kw_only=True)
class Part:
    depth: int = field(default=2, metadata=option("a depth"))
    mode: str = field(default="x", metadata=option("a mode", name="part_mode"))
    hidden: int = 5  # an option too (no metadata needed), unless `only` leaves it out


@dataclass(kw_only=True)
class Whole:
    size: int = field(default=1, metadata=option("a size"))
    part: Part = field(default_factory=Part, metadata=group("the part"))
    maybe: Part | None = field(default=None, metadata=group("maybe", only=()))


def test_components_are_flat_on_the_command_line() -> None:
    p = argparse.ArgumentParser(prog="whole")
    add_options(p, Whole)
    text = p.format_help()
    assert "the part:" in text and "--part-mode" in text and "--hidden" in text
    got = from_args(Whole, p.parse_args(["--depth", "3", "--part-mode", "y", "--size", "4"]))
    assert got == Whole(size=4, part=Part(depth=3, mode="y"))
    assert flatten(got) == {"size": 4, "depth": 3, "part_mode": "y", "hidden": 5}
    assert build(Whole, flatten(got)) == got
    with pytest.raises(TypeError, match="has no option mode"):
        build(Whole, {"mode": "y"})  # the field's name is not the option's


def test_an_option_declared_twice_is_refused() -> None:
    @dataclass(kw_only=True)
    class Twice:
        depth: int = field(default=1, metadata=option("again"))
        part: Part = field(default_factory=Part, metadata=group("the part"))

    with pytest.raises(TypeError, match=r"options \['depth'\] are declared twice"):
        add_options(argparse.ArgumentParser(), Twice)


# ------------------------------------------------------------------------ schedule
def test_warmup_then_cosine() -> None:
    kw = {"peak": 1.0, "steps": 110, "warmup_steps": 10}
    assert [lr_at(s, **kw) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(11, **kw) == pytest.approx(1.0)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    mid = lr_at(60, **kw)
    assert 0.5 < mid < 0.6
    # Goyal et al.: warm-up from the unscaled rate to the scaled one
    assert lr_at(1, peak=0.8, steps=50, warmup_steps=4, start=0.2) == pytest.approx(0.35)
    assert lr_at(30, peak=0.8, steps=50, decay="none") == 0.8


# ------------------------------------------------------- preflight and the command line
def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name)
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'plait\[digits\]'"):
        job.configure({})
    job.configure({"data": "synthetic"})  # needs nothing


def test_unwritable_out_and_missing_checkpoint(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to"):
        job.configure({"out": str(blocker / "sub")})
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        job.configure({"out": str(tmp_path), "resume": True})

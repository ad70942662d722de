"""`plait train --strategy ps`: options and their checks, the recipe -> servers mapping, and
the roles under a launcher (whole jobs are in tests/e2e/test_train_ps_command.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.options import from_args
from plait.ps.config import PSConfig
from plait.train import job, outdir
from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError


def _config(**options: Any) -> TrainConfig:
    return TrainConfig.from_options(options)


def test_ps_defaults_and_allreduce_leaves_them_unset() -> None:
    c = _config(strategy="ps")
    assert c.ps is not None and c.servers == 2
    assert (c.ps.mode, c.ps.staleness, c.ps.stale_policy) == ("sync", 4, "accept")
    s = _config(strategy="ps", ps_mode="ssp", workers=2)
    assert s.ps is not None and s.ps.staleness == 4 and s.ps.warm_start_steps == 0
    a = TrainConfig()
    assert (a.servers, a.ps) == (None, None)
    d = _config(strategy="ps", ps_mode="async", stale_policy="drop", staleness=2)
    assert d.ps is not None and (d.ps.staleness, d.ps.drop_bound) == (2, 2)
    assert TrainConfig.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    # the ps options are PSConfig's own: declared once, with one default
    assert d.options()["staleness"] == 2 and PSConfig().staleness == c.ps.staleness


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"servers": 2}, "--servers applies to --strategy ps only, not --strategy allreduce"),
        ({"ps_mode": "async", "staleness": 3}, "--ps-mode, --staleness apply to --strategy ps"),
        ({"strategy": "ps", "servers": 0}, "servers 0 < 1"),
        ({"strategy": "ps", "ps_mode": "ssp", "staleness": -1}, "staleness (tau) must be >= 0"),
        ({"strategy": "ps", "staleness": 2}, "--staleness 2 applies to --ps-mode ssp"),
        ({"strategy": "ps", "ps_mode": "bsp"}, "mode must be one of sync, async, ssp; got 'bsp'"),
        ({"strategy": "ps", "ps_mode": "ssp", "stale_policy": "x"}, "one of accept, drop"),
        ({"strategy": "ps", "stale_policy": "drop"}, "apply to --ps-mode async or ssp"),
        ({"strategy": "ps", "ps_mode": "async", "warm_start_steps": -1}, "warm_start_steps"),
        ({"strategy": "ps", "elastic": True, "out": "/x"}, "--strategy ps does not write chec"),
        ({"worker_timeout": 3.0}, "--worker-timeout applies to --strategy ps only, not --strat"),
        ({"strategy": "ps", "worker_timeout": 0.0}, "worker_timeout_s must be a finite number"),
        ({"strategy": "ps", "ps_mode": "async", "worker_timeout": -1.0}, "> 0; got -1.0"),
        ({"strategy": "ps", "worker_timeout": float("nan")}, "> 0; got nan"),
        ({"strategy": "ps", "worker_timeout": float("inf")}, "> 0; got inf"),
    ],
)
def test_bad_ps_options_say_what_is_wrong(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**options)
    assert message in str(err.value)


def test_worker_timeout_is_psconfigs_own_in_every_mode() -> None:
    """--worker-timeout is PSConfig.worker_timeout_s; sync takes it too (a silent worker
    fails a sync job, naming it), anything but --strategy ps refuses it, default or not."""
    from plait.cli.main import build_parser

    c = _config(strategy="ps")
    assert c.ps is not None and c.ps.worker_timeout_s == PSConfig().worker_timeout_s == 10.0
    for mode in ("sync", "async", "ssp"):
        argv = ["train", "--strategy", "ps", "--ps-mode", mode, "--worker-timeout", "2.5"]
        t = from_args(TrainConfig, build_parser().parse_args(argv))
        assert t.ps is not None and (t.ps.mode, t.ps.worker_timeout_s) == (mode, 2.5)
        assert TrainConfig.from_dict(json.loads(json.dumps(t.to_dict()))) == t
        given = job.configure({"strategy": "ps", "ps_mode": mode, "worker_timeout": 2.5})
        assert given.ps is not None and given.ps.worker_timeout_s == 2.5
    with pytest.raises(ConfigError, match="--worker-timeout applies to --strategy ps only"):
        job.configure({"worker_timeout": 10.0})  # the default, given in vain


def test_recipes_map_onto_the_servers_optimizers() -> None:
    sgd = _config(strategy="ps", ps_mode="ssp", staleness=3, lr=0.2).ps
    assert sgd is not None
    assert (sgd.optimizer, sgd.momentum, sgd.weight_decay, sgd.lr) == ("sgd", 0.9, 1e-4, 0.2)
    assert (sgd.mode, sgd.staleness, sgd.drop_bound) == ("ssp", 3, None)
    adam = _config(strategy="ps", model="gpt", ps_mode="async", stale_policy="drop",
                   staleness=5).ps  # fmt: skip
    assert adam is not None
    assert (adam.optimizer, adam.betas, adam.weight_decay) == ("adam", (0.9, 0.95), 0.0)
    assert (adam.stale_policy, adam.drop_bound) == ("drop", 5)


def test_under_a_launcher_the_last_ranks_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("PLAIT_SERVERS", "1")
    c = job.configure({"strategy": "ps", "data": "synthetic"})
    assert (c.workers, c.servers) == (4, 1)
    with pytest.raises(ConfigError, match="servers 2 != PLAIT_SERVERS 1"):
        job.configure({"strategy": "ps", "servers": 2, "data": "synthetic"})
    with pytest.raises(ConfigError, match=r"workers 2 != WORLD_SIZE 5 - servers 1"):
        job.configure({"strategy": "ps", "workers": 2, "data": "synthetic"})
    monkeypatch.delenv("PLAIT_SERVERS")
    c = job.configure({"strategy": "ps", "servers": 3, "batch_size": 8, "data": "synthetic"})
    assert (c.workers, c.servers) == (2, 3)
    with pytest.raises(ConfigError, match="pass --servers S"):
        job.configure({"strategy": "ps", "data": "synthetic"})


def test_resume_looks_for_the_parameter_servers_manifest(tmp_path: Path) -> None:
    """--resume under --strategy ps wants ps-checkpoint.json before any worker starts; a run
    that failed after one was written is told the command that resumes it."""
    with pytest.raises(CheckpointError, match=r"ps-checkpoint\.json does not exist"):
        job.configure({"strategy": "ps", "out": str(tmp_path), "resume": True})
    manifest = {"files": [{"name": "s.pt", "bytes": 3}], "common": {"name": "c.pt", "bytes": 0}}
    (tmp_path / "ps-checkpoint.json").write_text(json.dumps(manifest))
    (tmp_path / "c.pt").write_bytes(b"")
    (tmp_path / "s.pt").write_bytes(b"12")  # the files' sizes too, before any worker starts
    with pytest.raises(CheckpointError, match=r"s\.pt has 2 bytes; .* says 3: the file is trunc"):
        job.configure({"strategy": "ps", "out": str(tmp_path), "resume": True})
    (tmp_path / "s.pt").write_bytes(b"123")
    config = job.configure({"strategy": "ps", "out": str(tmp_path), "resume": True})
    assert config.row.checkpoints and config.checkpoint.resume
    hint = outdir.resume_hint(str(tmp_path), True, ["train", "--out", str(tmp_path)],
                              manifest="ps-checkpoint.json")  # fmt: skip
    assert hint.endswith(f"plait train --out {tmp_path} --resume")


class _Counter:
    """The store's counter of claimed slices (`add` returns the new value)."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, key: str, amount: int) -> int:
        self.value += amount
        return self.value


def test_a_resumed_async_run_claims_the_slices_after_its_step() -> None:
    """Resumed after step 3 of 5 with 2 workers, async and ssp claim steps 4 and 5's four
    slices, in order (sync trains every step after it: every_step)."""
    from plait.train.steps.ps import ParameterServerStep

    step = object.__new__(ParameterServerStep)  # the claims need its store and mode only
    step.ps, step.store, step.world_size = PSConfig(mode="async"), _Counter(), 2
    assert list(step.slices(3, 5)) == [(4, 0), (4, 1), (5, 0), (5, 1)]

"""`plait train --elastic`'s options: what it does not run with yet, the workers' bounds,
the options that mean nothing without it, the launcher it needs under `plait run`; and the
new rank 0's events reaching the `plait train` process (the run itself:
tests/e2e/test_elastic_command.py)."""

from __future__ import annotations

import io

import pytest

from plait.train import job, progress
from plait.train.config import TrainConfig
from plait.train.errors import ConfigError


def _elastic(**options: object) -> TrainConfig:
    return TrainConfig.from_options({"elastic": True, **options})


def test_the_bounds_default_to_one_and_the_starting_workers() -> None:
    assert _elastic(zero=3).zero == 3  # ZeRO's shards go elastic (plait.sharded.ElasticShards)
    e = _elastic(workers=4).elastic
    assert (e.min_workers, e.max_workers, e.batch_policy) == (1, 4, "global")
    e = _elastic(workers=4, min_workers=2, max_workers=6, batch_policy="per-rank").elastic
    assert (e.min_workers, e.max_workers) == (2, 6)
    assert e.policy(64, 4).lr_factor(3) == 0.75  # per-rank: 16 each, lr x n/4
    ps = _elastic(strategy="ps").ps  # the servers' sync rounds go on over live workers
    assert ps is not None and ps.mode == "sync" and ps.elastic_workers


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "ps", "ps_mode": "ssp"}, "--strategy ps runs --ps-mode sync only, not ssp"),
        ({"strategy": "ps", "trace": "t.json"}, "--strategy ps does not run with --trace yet"),
        ({"strategy": "ps", "priority": True}, "its per-layer waits are not tested"),
        ({"pp": 2}, "pipelines and tensor parallelism are not elastic yet"),
        ({"model": "gpt", "tp": 2}, "pipelines and tensor parallelism are not elastic yet"),
        ({"zero": 2, "optimizer": "lars"}, "--elastic --zero 2 does not run with --optimizer lars"),
        ({"priority": True}, "--elastic does not run with --priority yet"),
        ({"workers": 4, "min_workers": 5}, "--min-workers 5 > --workers 4"),
        ({"workers": 4, "max_workers": 3}, "--max-workers 3 < --workers 4: the run starts with 4"),
        ({"min_workers": 0}, "--min-workers 0 < 1"),
        ({"batch_size": 8, "workers": 4, "max_workers": 16}, "global batch 8 < 16 workers"),
    ],
)
def test_what_elastic_does_not_run_with_is_refused(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _elastic(**options)
    assert message in str(err.value)


def test_its_options_are_refused_without_it() -> None:
    with pytest.raises(ConfigError, match="--min-workers, --batch-policy apply to elastic"):
        job.configure({"min_workers": 2, "batch_policy": "global"})  # a default given, too


def test_under_a_launcher_it_needs_one_that_hosts_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(ConfigError, match="start it with `plait run -n N --min-np M"):
        job.configure({"elastic": True})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    with pytest.raises(ConfigError, match="under a launcher its own options do"):
        job.configure({"elastic": True, "min_workers": 1})
    under = job.configure({"elastic": True})
    assert under.workers == 2 and under.elastic.min_workers is under.elastic.max_workers is None
    # a joiner runs the run's command; the launcher's WORLD_SIZE counts it: not the workers
    monkeypatch.setenv("PLAIT_ELASTIC_JOIN", "1")
    monkeypatch.setenv("WORLD_SIZE", "5")
    joiner = job.configure({"elastic": True, "batch_size": 64, "min_workers": 2})
    assert joiner.workers == 1 and joiner.elastic.min_workers is None  # from the run's state
    assert job.configure({"elastic": True, "workers": 4, "max_workers": 6}).workers == 4


def test_the_new_rank_0s_events_are_rendered() -> None:
    shown = io.StringIO()
    stream = progress.RankZeroStream(progress.Text(shown), any_rank=True)
    change = {"generation": 1, "step": 3, "left": [0], "joined": 0, "workers": 3,
              "batch": "global batch 9 (3 per worker)"}  # fmt: skip
    wire = io.StringIO()
    progress.Events(wire).handle("membership", change)
    stream.write("[rank 1] " + wire.getvalue())
    stream.write("[rank 2] a plain line\n")
    assert shown.getvalue().splitlines() == [
        "membership: rank 0 left (generation 1); 3 workers redo step 3 with global batch 9 "
        "(3 per worker)",
        "[rank 2] a plain line",
    ]


def test_ps_workers_under_a_launcher_and_a_ps_joiner(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "PLAIT_SERVERS": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    ps = {"strategy": "ps", "elastic": True}
    with pytest.raises(ConfigError, match="needs one that hosts the job's store"):
        job.configure(ps)  # plait run without --min-np: worker 0 hosts it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    under = job.configure(ps)  # plait run -n 2 --servers 1 --min-np N
    assert under.workers == 2 and under.elastic.min_workers is None
    assert under.ps is not None and under.ps.elastic_workers
    # a joiner runs the run's command: its --workers and --max-workers, whatever WORLD_SIZE
    monkeypatch.setenv("PLAIT_ELASTIC_JOIN", "1")
    monkeypatch.setenv("WORLD_SIZE", "7")
    joiner = job.configure({**ps, "workers": 2, "servers": 1, "max_workers": 3})
    assert (joiner.workers, joiner.elastic.max_workers) == (2, 3)


def test_a_ps_change_and_its_summary_rows() -> None:
    change = {"round": 5, "step": 6, "left": [0], "joined": 0, "workers": 2, "lost": [0],
              "untrained": 4, "name": "worker",
              "batch": "global batch 12 (6 per worker)"}  # fmt: skip
    assert progress.membership_line(change) == (
        "membership: worker 0 left in round 5; 4 samples of step 5 not trained (no gradient "
        "from worker 0): step 6 trains them first; 2 workers go on from step 6 with global "
        "batch 12 (6 per worker)"
    )
    e = {"policy": "p", "changes": [change], "untrained": 3}
    rows = dict(progress.elastic_rows({"world_size": 2, "elastic": e}))
    assert rows["membership"] == "step 6: worker 0 left -> 2 workers (round 5, 4 samples put back)"
    assert "commit" not in rows and rows["untrained"].startswith("3 samples of the last step")

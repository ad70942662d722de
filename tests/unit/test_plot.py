"""`plait plot`: the step-time breakdown's arithmetic (by hand, on hand-made traces), and
every figure written from synthetic run, benchmark and trace files (needs matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.errors import ConfigError, MissingExtraError
from plait.plots import breakdown
from support import synthetic_trace as st

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
needs_mpl = pytest.mark.skipif(
    not HAVE_MPL, reason="matplotlib is not installed (pip install 'plait[plot]')"
)


# ---- the breakdown, a pure function -------------------------------------------------------


def test_breakdown_by_hand() -> None:
    """The numbers worked out in synthetic_trace.data_parallel's docstring: the nested
    forward:<block> spans count once, the allreduce is exposed only past the backward."""
    times = breakdown.step_times(st.data_parallel(steps=3, ranks=2)["traceEvents"])
    assert len(times) == 6
    for t in times:
        expected_idle = 150.0 if t.rank == 0 else 250.0
        assert (t.compute, t.exposed_comm, t.idle) == (750.0, 100.0, expected_idle)
        assert t.compute + t.exposed_comm + t.idle == pytest.approx(t.total)
    assert [t.step for t in times if t.rank == 1] == [1, 2, 3]


def test_breakdown_hidden_and_outside_the_step() -> None:
    """Communication under compute costs nothing; spans outside the step do not count."""
    events = [
        st.span("step", "step 1", 0, 100, 100, step=1),
        st.span("compute", "backward", 0, 100, 50),
        # on the communication thread (tid 1): the computing thread goes on meanwhile
        st.span("comm", "allreduce", 0, 120, 20, tid=1),  # hidden under backward
        st.span("comm", "allreduce", 0, 140, 30, tid=1),  # 20 of it exposed: [150, 170)
        st.span("ps", "wait", 0, 190, 40, tid=1),  # 10 inside the step, exposed
        st.span("compute", "forward", 0, 0, 90),  # before the step
    ]
    (t,) = breakdown.step_times(events)
    assert (t.total, t.compute, t.exposed_comm, t.idle) == (100.0, 50.0, 30.0, 20.0)


def test_mean_by_rank_leaves_out_the_first_step() -> None:
    events = st.data_parallel(steps=3, ranks=1)["traceEvents"]
    events += [st.span("compute", "warm-up", 0, 860, 100)]  # only step 1 grows
    means = breakdown.mean_by_rank(breakdown.step_times(events))
    assert means[0].step == 2 and means[0].idle == 150.0 and means[0].compute == 750.0


def test_a_trace_without_steps_is_said_so() -> None:
    with pytest.raises(ValueError, match="no 'step' spans"):
        breakdown.step_times([st.span("compute", "forward", 0, 0, 10)])


# ---- the figures --------------------------------------------------------------------------


def _run(strategy: str, workers: int, steps: int = 20) -> dict[str, object]:
    return {
        "strategy": strategy, "world_size": workers, "steps": steps, "model": "mlp",
        "data": "digits", "eval_name": "held-out accuracy", "samples_per_s": 1000.0,
        "losses": [2.3 / (1 + 0.1 * i) for i in range(steps)],
        "evals": [[s, 0.5 + s / 50] for s in range(4, steps + 1, 4)],
        "throughput": [[s, 900.0 + s] for s in range(2, steps + 1, 2)],
    }  # fmt: skip


def _bench_collectives() -> dict[str, object]:
    sizes = {"4096": 1e-4, "65536": 5e-4, "1048576": 4e-3}
    results = {
        size: {a: [t * f * (1 + 0.01 * r) for r in range(3)]
               for a, f in (("torch", 1.0), ("native", 1.1), ("ring", 0.8), ("auto", 0.9))}
        for size, t in sizes.items()
    }  # fmt: skip
    return {"world_size": 4, "results": results, "memcpy_GBps": 8.0}


def _bench_train() -> dict[str, object]:
    rows = [
        {"workload": w, "world_size": n, "device": "cpu", "parameters": 1000, "global_batch": 32,
         "plait_samples_per_s": 100.0 * n, "ddp_samples_per_s": 90.0 * n, "ratio": 1.1,
         "ratio_min": 1.0, "ratio_max": 1.2}
        for w in ("cnn", "gpt") for n in (2, 4)
    ]  # fmt: skip
    return {"runs": [], "summary": rows}


def _bench_comm() -> dict[str, object]:
    rows = [
        {"rate": rate, "workload": "wide", "way": way, "ranks": 4, "hosts": 2,
         "samples_per_s": 100.0, "vs_fifo": 1.0 if way == "fifo" else v, "sent_bytes": 1e6,
         "step_s": 0.1, "compute_s": None}
        for rate in ("100mbit", "1gbit") for way, v in (("fifo", 1), ("fp16", 1.5), ("ddp", 0.9))
    ]  # fmt: skip
    return {"runs": {}, "summary": rows}


def _write(folder: Path, name: str, data: object) -> str:
    path = folder / name
    path.write_text(json.dumps(data))
    return str(path)


@needs_mpl
def test_legends_name_the_model_where_the_runs_differ() -> None:
    from plait.plots.curves import labels

    same = [("a.json", _run("allreduce", 4)), ("b.json", _run("ps", 2))]
    assert labels(same) == ["allreduce, 4 workers", "ps, 2 workers"]  # the title names mlp
    other = [("a.json", _run("allreduce", 4)), ("b.json", {**_run("allreduce", 4), "model": "cnn"})]
    assert labels(other) == ["mlp: allreduce, 4 workers", "cnn: allreduce, 4 workers"]


def test_every_figure_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [
        _write(tmp_path, "allreduce.json", _run("allreduce", 4)),
        _write(tmp_path, "ps.json", {**_run("ps", 2), "ps_mode": "async"}),
        _write(tmp_path, "coll.json", _bench_collectives()),
        _write(tmp_path, "train.json", _bench_train()),
        _write(tmp_path, "comm.json", _bench_comm()),
    ]
    trace = _write(tmp_path, "pp.json", st.pipeline(stages=2, micro=4, steps=3))
    out = tmp_path / "plots"
    assert main(["plot", *files, "--trace", trace, "-o", str(out)]) == 0
    names = {"curves.png", "throughput.png", "step_breakdown.png", "pipeline_gantt.png",
             "bench-coll.png", "bench-train.png", "bench-comm.png"}  # fmt: skip
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (out / name).stat().st_size > 10_000, name  # a drawing, not an empty canvas
    assert f"wrote {out / 'curves.png'}" in capsys.readouterr().out


@needs_mpl
def test_what_cannot_be_drawn_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An old run (no per-log throughput) and a trace without a pipeline: notes, no error."""
    old = _run("allreduce", 2)
    del old["throughput"]
    files = [_write(tmp_path, "old.json", old)]
    trace = _write(tmp_path, "dp.json", st.data_parallel())
    assert main(["plot", *files, "--trace", trace, "-o", str(tmp_path / "o")]) == 0
    said = capsys.readouterr().out
    assert "no throughput curve for old" in said
    assert "no pipeline Gantt chart" in said
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "curves.png",
        "step_breakdown.png",
    ]


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _write(tmp_path, "other.json", {"hello": 1})
    assert main(["plot", other, "-o", str(tmp_path)]) == 2
    assert "is none of: a `plait train --json` file" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["plot"]) == 2
    assert "nothing to plot" in capsys.readouterr().err


def test_without_matplotlib_the_message_names_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plait.plots import mpl, plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(MissingExtraError, match=r"pip install 'plait\[plot\]'"):
        mpl.pyplot()
    run = _write(tmp_path, "run.json", _run("allreduce", 2))
    with pytest.raises(MissingExtraError, match="matplotlib"):
        plot([run], tmp_path / "o")
    assert not (tmp_path / "o").exists()  # nothing half-made
    with pytest.raises(ConfigError):
        plot([], tmp_path / "o")

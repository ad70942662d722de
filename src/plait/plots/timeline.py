"""Figures of a trace: the step-time breakdown per rank, and the pipeline's Gantt chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.plots import breakdown, mpl
from plait.plots.breakdown import Event

# compute, exposed communication, idle: the order of the stack, bottom up
PARTS = (("compute", "compute", "#4c72b0"), ("exposed_comm", "exposed communication", "#dd8452"),
         ("idle", "idle (data, waiting, the loop)", "#c7c7c7"))  # fmt: skip


def _rank_label(rank: int, names: dict[int, str]) -> str:
    return names.get(rank) or f"rank {rank}"


def step_breakdown(events: list[Event], out: Path) -> Path:
    """Stacked bars, one per rank: its mean step's compute, exposed communication and idle."""
    times = breakdown.step_times(events)
    means = breakdown.mean_by_rank(times)
    names = breakdown.rank_names(events)
    ranks = list(means)
    fig, ax = mpl.figure(max(6.0, 1.0 + 0.9 * len(ranks)), 4.2)
    bottom = [0.0] * len(ranks)
    xs = range(len(ranks))
    for field, label, color in PARTS:
        ms = [getattr(means[r], field) / 1e3 for r in ranks]
        ax.bar(xs, ms, bottom=bottom, label=label, color=color, width=0.6)
        bottom = [b + v for b, v in zip(bottom, ms, strict=True)]
    for x, r in zip(xs, ranks, strict=True):  # each bar's share that was compute
        share = means[r].compute / means[r].total if means[r].total else 0.0
        ax.annotate(f"{share:.0%}", (x, bottom[x]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
    counts = {m.step for m in means.values()}
    traced = len({t.step for t in times})
    over = f"{counts.pop()} steps" if len(counts) == 1 else "its steps"
    if traced >= 3:
        over += " (the first, a warm-up, left out)"
    ax.set_title(f"step time per rank, mean over {over}; % = compute's share", fontsize=10)
    ax.set_xticks(list(xs), [_rank_label(r, names) for r in ranks])
    ax.set_ylabel("ms per step")
    ax.set_ylim(top=max(bottom) * 1.1 if bottom and max(bottom) > 0 else 1.0)
    mpl.grid(ax)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=3,
              frameon=False)  # fmt: skip
    return mpl.save(fig, out / "step_breakdown.png")


def _window(events: list[Event], pipeline: list[Event]) -> tuple[float, float, str]:
    """The span the Gantt chart shows: one step, from its earliest start on any rank to its
    latest end. The last step that has pipeline events: past the first step's warm-up."""
    steps = breakdown.spans(events, ("step",))
    starts = [float(e["ts"]) for e in pipeline]
    chosen = [s for s in steps if float(s["ts"]) <= max(starts)]
    if not chosen:  # pipeline events but no step spans: show them all
        ends = [float(e["ts"]) + float(e.get("dur", 0)) for e in pipeline]
        return min(starts), max(ends), "all steps"
    number = max(s.get("args", {}).get("step", 0) for s in chosen)
    mine = [s for s in steps if s.get("args", {}).get("step", 0) == number] or chosen[-1:]
    begin = min(float(s["ts"]) for s in mine)
    end = max(float(s["ts"]) + float(s.get("dur", 0)) for s in mine)
    return begin, end, f"step {number}"


def gantt(events: list[Event], out: Path) -> Path | None:
    """Each rank's forwards (F, light) and backwards (B, dark) per micro-batch over one step,
    with its communication beneath as thin bars; None when the trace has no pipeline."""
    pipeline = breakdown.spans(events, ("pipeline",))
    if not pipeline:
        return None
    begin, end, which = _window(events, pipeline)
    shown = [e for e in pipeline if e["ts"] < end and e["ts"] + e.get("dur", 0) > begin]
    comm = [e for e in breakdown.spans(events, breakdown.COMMUNICATION)
            if e["ts"] < end and e["ts"] + e.get("dur", 0) > begin]  # fmt: skip
    ranks = sorted({int(e["pid"]) for e in shown})
    names = breakdown.rank_names(events)
    micro = sorted({int(e.get("args", {}).get("mb", 0)) for e in shown})
    plt = mpl.pyplot()
    cmap = plt.get_cmap("tab10")
    fig, ax = mpl.figure(10.0, 1.0 + 0.7 * len(ranks))
    for e in shown:
        row = ranks.index(int(e["pid"]))
        mb = int(e.get("args", {}).get("mb", 0))
        start, dur = (float(e["ts"]) - begin) / 1e3, float(e.get("dur", 0)) / 1e3
        backward = str(e.get("name", "")).startswith("B")
        color = cmap(micro.index(mb) % 10)
        ax.barh(row, dur, left=start, height=0.6, color=color, alpha=1.0 if backward else 0.45,
                edgecolor="black", linewidth=0.4)  # fmt: skip
        if dur > (end - begin) / 1e3 / 60:  # a label only where it fits
            ax.text(start + dur / 2, row, str(e.get("name", "")), ha="center", va="center",
                    fontsize=7)  # fmt: skip
    for e in comm:
        if int(e["pid"]) in ranks:
            start, dur = (float(e["ts"]) - begin) / 1e3, float(e.get("dur", 0)) / 1e3
            ax.barh(ranks.index(int(e["pid"])) + 0.38, dur, left=start, height=0.12,
                    color="#dd8452")  # fmt: skip
    ax.set_yticks(range(len(ranks)), [_stage_label(r, names, shown) for r in ranks])
    ax.invert_yaxis()  # rank 0 (the first stage) on top, as schedules are printed
    ax.set_xlabel(f"ms since the start of {which}")
    ax.set_title(f"pipeline, {which}: F = forward (light), B = backward (dark), one colour per "
                 "micro-batch; orange: communication", fontsize=10)  # fmt: skip
    ax.set_xlim(0, (end - begin) / 1e3)
    mpl.grid(ax)
    return mpl.save(fig, out / "pipeline_gantt.png")


def _stage_label(rank: int, names: dict[int, str], shown: list[dict[str, Any]]) -> str:
    stages = sorted(
        {e.get("args", {}).get("stage") for e in shown if int(e["pid"]) == rank} - {None}
    )
    where = f" (stage {', '.join(map(str, stages))})" if stages else ""
    return _rank_label(rank, names) + where

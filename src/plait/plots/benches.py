"""Figures of `plait bench ... --json` files: the tables' numbers, as pictures.

Each benchmark's own `summarize` (bench/NAME/tables.py) turns its JSON into rows, so the figures
show exactly the table's numbers: collectives' raw timings are summarized here; train's
and comm's files hold their rows already ("summary").
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from plait.plots import mpl
from plait.sizes import format_size


def kind(data: Any) -> str | None:
    """Which benchmark wrote `data`: collectives, train or comm; None if none of them."""
    if not isinstance(data, dict):
        return None
    if "results" in data and "world_size" in data:
        return "collectives"
    rows = data.get("summary")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        if "plait_samples_per_s" in rows[0]:
            return "train"
        if "vs_fifo" in rows[0]:
            return "comm"
    return None


def collectives(data: dict[str, Any], out: Path, stem: str) -> Path:
    """allreduce time by size per algorithm (log-log), and speed relative to torch."""
    from plait.bench.collectives.tables import summarize

    rows = summarize(data)
    by_algorithm: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_algorithm[r["algorithm"]].append(r)
    fig, (times, speed) = mpl.figure(11.0, 4.2, ncols=2)
    cmap = mpl.pyplot().get_cmap("tab10")
    for i, (algorithm, mine) in enumerate(by_algorithm.items()):
        mine.sort(key=lambda r: r["size"])
        sizes = [r["size"] for r in mine]
        # one colour per algorithm in both panels; torch, the reference, dashed black
        style = (
            {"linestyle": "--", "color": "black"}
            if algorithm == "torch"
            else {"color": cmap(i % 10)}
        )
        times.plot(sizes, [r["time_us"] / 1e3 for r in mine], marker="o", markersize=4,
                   label=algorithm, **style)  # fmt: skip
        if algorithm != "torch" and all(r["vs_torch"] is not None for r in mine):
            speed.plot(sizes, [r["vs_torch"] for r in mine], marker="o", markersize=4,
                       **style)  # fmt: skip
    where = f"{data['world_size']} ranks"
    if data.get("num_nodes", 1) > 1:
        where += f" on {data['num_nodes']} hosts"
    times.set_title(f"allreduce, float32, {where}: median time")
    times.set_ylabel("ms")
    speed.set_title("speed vs torch.distributed (> 1: faster)")
    speed.set_ylabel("torch's time / this time (median of repeats)")
    speed.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    sizes = sorted({r["size"] for r in rows})
    for ax in (times, speed):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("bytes per rank")
        mpl.grid(ax)
    times.set_yscale("log")
    mpl.plain_log_ticks(times.yaxis)
    mpl.legend_below(fig, times, ncols=len(by_algorithm))
    return mpl.save(fig, out / f"{stem}.png")


def train(data: dict[str, Any], out: Path, stem: str) -> Path:
    """Samples/s by number of ranks, plait and DDP per workload; and their ratio."""
    rows = data["summary"]
    fig, (rate, ratio) = mpl.figure(11.0, 4.2, ncols=2)
    plt = mpl.pyplot()
    for i, name in enumerate(dict.fromkeys(r["workload"] for r in rows)):
        mine = sorted((r for r in rows if r["workload"] == name), key=lambda r: r["world_size"])
        ranks = [r["world_size"] for r in mine]
        color = plt.get_cmap("tab10")(i % 10)
        rate.plot(ranks, [r["plait_samples_per_s"] for r in mine], marker="o", color=color,
                  label=f"{name}: plait")  # fmt: skip
        rate.plot(ranks, [r["ddp_samples_per_s"] for r in mine], marker="s", color=color,
                  linestyle="--", label=f"{name}: DDP")  # fmt: skip
        mid = [r["ratio"] for r in mine]
        low = [r["ratio"] - r["ratio_min"] for r in mine]
        high = [r["ratio_max"] - r["ratio"] for r in mine]
        ratio.errorbar(ranks, mid, yerr=[low, high], marker="o", color=color, capsize=3,
                       label=name)  # fmt: skip
    rate.set_title("training throughput (median of repeats)")
    rate.set_ylabel("samples/s (global)")
    rate.set_ylim(bottom=0)
    ratio.set_title("plait / DDP (bars: range over repeats; > 1: plait faster)")
    ratio.set_ylabel("ratio of samples/s")
    ratio.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    every = sorted({r["world_size"] for r in rows})
    for ax in (rate, ratio):
        ax.set_xticks(every)
        ax.set_xlabel("ranks")
        mpl.grid(ax)
        ax.legend(fontsize=8)
    return mpl.save(fig, out / f"{stem}.png")


def comm(data: dict[str, Any], out: Path, stem: str) -> Path:
    """Grouped bars: each way's samples/s relative to plait's FIFO, per link rate and
    workload (the communication wall: who gains where links are slow)."""
    rows = data["summary"]
    groups = list(dict.fromkeys((r["rate"], r["workload"]) for r in rows))
    ways = list(dict.fromkeys(r["way"] for r in rows))
    width = min(0.8 / len(ways), 0.2)  # a lone group's bars stay bars, not blocks
    fig, ax = mpl.figure(max(6.0, 1.2 + 0.35 * len(groups) * len(ways)), 4.2)
    for i, way in enumerate(ways):
        values = []
        for g in groups:
            cell = [r for r in rows if (r["rate"], r["workload"]) == g and r["way"] == way]
            values.append(cell[0]["vs_fifo"] if cell and cell[0]["vs_fifo"] is not None else 0)
        xs = [j + (i - (len(ways) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, values, width=width, label=way)
        ax.bar_label(bars, [f"{v:.2f}x" if v else "" for v in values], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    top = max((r["vs_fifo"] or 0 for r in rows), default=1.0)
    ax.set_ylim(0, max(top, 1.0) * 1.12)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    # a rate of "None": --hosts 1, this machine's loopback, no limit
    links = ["loopback" if rate in (None, "None") else f"{rate} link" for rate, _ in groups]
    ax.set_xticks(
        range(len(groups)), [f"{w}\n{link}" for (_, w), link in zip(groups, links, strict=True)]
    )
    hosts, ranks = rows[0]["hosts"], rows[0]["ranks"]
    where = f"{ranks} ranks" + (f" on {hosts} hosts" if hosts > 1 else ", one host")
    ax.set_title(f"the communication wall ({where}): samples/s vs plait FIFO (> 1: faster)",
                 fontsize=10)  # fmt: skip
    ax.set_ylabel("samples/s / FIFO's (median of repeats)")
    mpl.grid(ax)
    mpl.legend_below(fig, ax, ncols=min(7, len(ways)))
    return mpl.save(fig, out / f"{stem}.png")


FIGURES = {"collectives": collectives, "train": train, "comm": comm}

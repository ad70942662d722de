"""`plait plan --from-trace`'s output: the per-category table, the verdict, the refit."""

from __future__ import annotations

from plait.plan.fit import Fit
from plait.plan.from_trace import Comparison
from plait.plan.overheads import Overheads

MS = 1e3


def _aligned(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return [
        "  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                  for c, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        for r in [head, *rows]
    ]  # fmt: skip


def table(c: Comparison, source: str) -> str:
    """The header, the table of categories, and the verdict."""
    m, req = c.measured, c.request
    where = f"{req.hosts} hosts" if req.hosts > 1 else "one host"
    link = (
        f", linked at {req.link_rate or '1gbit'} (--link-rate: a trace does not record the link)"
        if req.hosts > 1 else ""
    )  # fmt: skip
    cpu = f", CPU {m.cpu_s * MS:.1f} ms" if m.cpu_s is not None else ""
    lines = [
        f"traced run {source}: {req.workload or req.model}, {c.plan.label()}, "
        f"{req.workers} workers on {where}{link}",
        f"measured over steps {', '.join(map(str, m.steps))} ({m.ranks} ranks, the median; "
        f"per rank): step {m.step_s * MS:.1f} ms (cadence: the next step's start; the step "
        f"span {m.span_s * MS:.1f} ms{cpu}); predicted {c.predicted_s * MS:.1f} ms",
    ]
    if m.cpu_s is not None and m.cpu_s < 0.5 * m.span_s:
        lines.append(
            f"each rank was on a CPU for {m.cpu_s / m.span_s:.0%} of its step span: it waited "
            "the rest, for its peers or for a core (other processes on this machine?)"
        )
    head = ("category", "simulated ms", "measured ms", "difference ms", "share of miss")
    rows: list[tuple[str, ...]] = [
        (cat, f"{sim * MS:.2f}", f"{got * MS:.2f}", f"{diff * MS:+.2f}",
         "" if share is None else f"{share:.0%}")
        for cat, sim, got, diff, share in c.rows()
    ]  # fmt: skip
    rows.append(("whole step", f"{c.predicted_s * MS:.2f}", f"{m.step_s * MS:.2f}",
                 f"{(m.step_s - c.predicted_s) * MS:+.2f}", "100%"))  # fmt: skip
    lines += _aligned(head, rows)
    lines.append(
        "(categories overlap where work runs on other threads, e.g. a bucket's allreduce "
        "under the backward, so the shares need not add up to 100%)"
    )
    lines.append(c.verdict())
    return "\n".join(lines)


def refitted(before: float, after: float, measured: float, result: Fit) -> str:
    """The prediction for this plan before and after the refit, and what changed."""
    o, neutral = result.overheads, Overheads()
    units = {"compute_scale": "x", "share": "", "memory_rank": " bytes", "memory_margin": ""}
    changed = [
        f"{name} {getattr(o, name):.4g}{units[name]}" if name in units
        else f"{name} {getattr(o, name) * MS:.3g} ms"
        for name in ("compute_scale", "share", "action", "message", "bucket", "collective",
                     "ps_request", "step_fixed", "memory_rank", "memory_margin")
        if getattr(o, name) != getattr(neutral, name)
    ]  # fmt: skip
    return "\n".join([
        f"refit with this run: predicted {before * MS:.1f} ms before, {after * MS:.1f} ms "
        f"after, measured {measured * MS:.1f} ms",
        "overheads: " + (", ".join(changed) if changed else "all neutral"),
    ])  # fmt: skip

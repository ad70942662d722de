"""What rank 0 shows: a progress bar on a terminal, plain log lines otherwise, and a summary.

The training loop emits records `(kind, dict)`:

    start   the run's shape (model, parameters, data, workers, batch, steps, ...)
    step    a step finished (bars advance; text ignores it)
    loss    the global-batch loss is known up to this step (bars update their loss)
    log     the same, at a log point (text prints a line)
    eval    an evaluation on held-out data
    membership  (--elastic) the workers changed: who left or joined, the step redone
    warning the loss is stalled or diverging (loss_trend.py): {"message"}
    finish  the summary (the --json figures and a few more)
    error   (events only) an error rank 0 explains: {"message", "code"}

A renderer turns them into output: `Bar` (rich, for terminals) or `Text` (one line per log
point, for pipes and files). Under `plait train` the workers' output goes through the
launcher's pipes, so rank 0 sends records as `Events` lines and the `plait train` process
renders them (`RankZeroStream`), with a bar when its own stdout is a terminal. With
--elastic rank 0 may die; the new rank 0 (whichever process that is) speaks from then on.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from plait.train import parts_compute

Record = dict[str, Any]
Emit = Callable[[str, Record], None]
MARK = "@@plait-train@@ "  # an event line, as rank 0 prints it
RANK0 = "[rank 0] "  # the launcher's prefix of rank 0's lines


class Renderer(Protocol):
    def handle(self, kind: str, rec: Record) -> None: ...
    def text(self, line: str) -> None: ...


def header(rec: Record) -> list[str]:
    replicas = rec.get("replicas", rec["workers"])
    workers = f"{rec['workers']} worker{'' if rec['workers'] == 1 else 's'}"
    split = workers if replicas == rec["workers"] else f"dp {replicas}"
    lines = [
        f"plait train: {rec['model']} ({rec['parameters']:,} parameters) on {rec['data']} "
        f"({rec['num_train']:,} train / {rec['num_val']:,} held-out {rec['unit']}s), "
        f"{split} x {rec['global_batch'] // replicas} = global batch "
        f"{rec['global_batch']}, {rec['steps']} steps, strategy {rec['strategy']}, "
        f"{rec['optimizer']} peak lr {rec['peak_lr']:g}, on {rec.get('device', 'cpu')}"
    ]
    if rec.get("mesh"):
        lines.append(f"mesh: {rec['mesh']} over {rec['workers']} workers")
    if rec.get("plan"):  # --plan: a per-layer plan's label
        lines.append(f"plan: {rec['plan']}")
    if rec.get("compute"):
        lines.append(f"compute: {rec['compute']}")
    if rec.get("elastic"):
        lines.append(elastic_line(rec["elastic"], rec["workers"]))
    if rec.get("resumed_from"):
        lines.append(f"resumed from {rec['resumed_from']} at step {rec['first_step']}")
    if rec.get("teacher"):
        lines.append(teacher_line(rec))
    return lines


def teacher_line(rec: Record) -> str:
    """--teacher: "distilled from DIR: MODEL, N parameters, its metric (T t, weight a)"."""
    t = rec["teacher"]
    if t.get("metric") is None:
        figure = "no held-out figure"
    elif t.get("metric_unit") == "%":
        figure = f"{t['metric_name']} {t['metric']:.1%}"
    else:
        # in the student's unit (nats/byte on code: the teacher trained on the same data)
        token = t.get("token") or rec.get("token")
        shown = _value(
            {"value": t["metric"], "eval_unit": t.get("metric_unit", ""), "token": token}
        )
        figure = f"{t['metric_name']} {shown}"
    return (
        f"distilled from {t['dir']}: {t['model']}, {t['parameters']:,} parameters, {figure} "
        f"(T {rec['distill_temperature']:g}, weight {rec['distill_weight']:g})"
    )


def elastic_line(e: Record, workers: int) -> str:
    """--elastic: the membership's bounds and the batch policy, in the run's header."""
    if e["min_workers"] is None:  # a launcher's (plait run --min-np, --max-np)
        return f"elastic: the launcher bounds the {workers} workers; {e['policy']}"
    return (
        f"elastic: goes on while at least {e['min_workers']} of the {workers} workers live "
        f"(at most {e['max_workers']}); {e['policy']}"
    )


def membership_line(rec: Record) -> str:
    """--elastic: a membership change, as the new rank 0 (with --strategy ps: the new
    reporting worker) reports it."""
    if "round" in rec:  # ps: seen in a round's reply; a lost share is trained next
        untrained = ""
        if rec["untrained"]:
            lost = ", ".join(map(str, rec["lost"]))
            untrained = (f"; {rec['untrained']} samples of step {rec['round']} not trained "
                         f"(no gradient from worker {lost}): step {rec['step']} trains them "
                         "first")  # fmt: skip
        return (
            f"membership: {_who(rec)} in round {rec['round']}{untrained}; {rec['workers']} "
            f"workers go on from step {rec['step']} with {rec['batch']}"
        )
    # after a failure the step in flight is trained again; a join comes at a commit
    again = "redo step" if rec["left"] else "go on from step"
    return (
        f"membership: {_who(rec)} (generation {rec['generation']}); {rec['workers']} workers "
        f"{again} {rec['step']} with {rec['batch']}"
    )


def _who(change: Record) -> str:
    """ "rank 0 left", "ranks 1, 3 left and 2 joined" ("worker 0 left" under ps)."""
    left, name = change["left"], change.get("name", "rank")
    who = [f"{name}{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} left"] if left else []
    who += [f"{change['joined']} joined"] if change["joined"] else []
    return " and ".join(who) or "no change"


def _when(change: Record) -> str:
    """ "(generation 2)", or under ps "(round 5, 4 samples put back)"."""
    if "round" not in change:
        return f"(generation {change['generation']})"
    back = f", {change['untrained']} samples put back" if change["untrained"] else ""
    return f"(round {change['round']}{back})"


def elastic_rows(rec: Record) -> list[tuple[str, str]]:
    """--elastic: the summary's rows: the policy, the changes, what a commit cost."""
    e = rec.get("elastic")
    if not e:
        return []
    changes = "; ".join(f"step {c['step']}: {_who(c)} -> {c['workers']} workers {_when(c)}"
                        for c in e["changes"])  # fmt: skip
    rows = [
        ("batch policy", e["policy"]),
        ("membership", changes or f"no change ({rec['world_size']} workers throughout)"),
    ]
    if "commit_s" in e:  # (ps: nothing is committed, the servers hold the state)
        rows.append(("commit", f"{1000 * e['commit_s']:.2f} ms per step, "
                               f"{e['commit_fraction']:.1%} of a step (state copied to host "
                               "memory)"))  # fmt: skip
    if e.get("untrained"):  # ps: a share lost in the last round
        why = "their worker pushed no gradient, and no step was left to train them"
        rows.append(("untrained", f"{e['untrained']} samples of the last step: {why}"))
    return rows


def log_line(rec: Record) -> str:
    width = len(str(rec["steps"]))
    return (
        f"step {rec['step']:>{width}}/{rec['steps']}  loss {rec['loss']:.4f}  "
        f"lr {rec['lr']:.3g}  {rec['samples_per_s']:,.0f} samples/s  {rec['elapsed_s']:.1f} s"
    )


def warning_line(rec: Record) -> str:
    return f"warning: {rec['message']}"


def eval_line(rec: Record) -> str:
    text = f"step {rec['step']}: {rec['name']} {_value(rec)}"
    if rec.get("baseline") is not None:
        text += f" (unigram baseline {rec['baseline']:.4f})"
    return text


def memory_rows(rec: Record) -> list[tuple[str, str]]:
    """--zero: the largest rank's model states next to ZeRO's formula (train/memory.py)."""
    m = rec.get("memory")
    if not m:
        return []
    mib = 1024 * 1024
    top = max(m["ranks"], key=lambda r: r["model_states"])
    f = m["formula"]
    return [
        (f"zero stage {rec['zero']}",
         f"model states {top['model_states'] / mib:.1f} MiB per rank (formula "
         f"{f['model_states'] / mib:.1f}, {top['vs_formula']:.2f}x): parameters "
         f"{top['parameters'] / mib:.1f}, gradients {top['gradients'] / mib:.1f}, optimizer "
         f"{top['optimizer'] / mib:.1f}"),
    ]  # fmt: skip


def summary(rec: Record) -> list[str]:
    ev = dict(rec, name=rec["eval_name"], value=rec["eval_value"])
    rows = [
        ("steps", f"{rec['steps']} (global batch {rec['global_batch']}, "
                  f"{rec['world_size']} workers, strategy {rec['strategy']})"),
        ("final training loss", f"{rec['final_loss']:.4f} (mean of the last "
                                f"{rec['final_loss_steps']} steps)" if rec["final_loss_steps"]
                                else "none: worker 0, which reports, trained no slice"),
        (rec["eval_name"], f"{_value(ev)} ({rec['eval_samples']:,} held-out "
                           f"{rec['unit']}s)"),
    ]  # fmt: skip
    if rec.get("eval_baseline") is not None:
        rows.append(("unigram baseline", f"{rec['eval_baseline']:.4f} nats/{rec['token']}"))
    if rec.get("ps_mode") is not None:
        rows.append(("parameter servers", f"{rec['servers']}, {rec['ps_mode']}: staleness max "
                     f"{rec.get('max_staleness', 0)}, mean {rec.get('mean_staleness', 0):.2f}; "
                     f"{rec.get('dropped_gradients', 0)} gradients dropped; dead workers "
                     f"{rec.get('dead_workers') or 'none'}"))  # fmt: skip
    if rec.get("pp") is not None:
        rows.append(("mesh", f"dp {rec['dp']} x pp {rec['pp']} x tp {rec['tp']}, "
                     f"{rec['chunks']} chunks, {rec['schedule']}: bubble "
                     f"{rec['bubble_fraction']:.3f} (theory {rec['bubble_theory']:.3f}), "
                     f"peak activations per stage {rec['peak_activations']}"))  # fmt: skip
    if rec.get("loss_trend"):  # stalled or diverging at the end (loss_trend.py)
        rows.append(("warning", rec["loss_trend"]["message"]))
    rows += parts_compute.rows(rec)
    rows += memory_rows(rec)
    rows += elastic_rows(rec)
    rows += trace_rows(rec)
    rows += [
        ("samples/s", f"{rec['samples_per_s']:,.0f} (global, training steps only)"),
        ("wall time", f"{rec['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return ["summary:"] + [f"  {k:<{width}}  {v}" for k, v in rows]


def trace_rows(rec: Record) -> list[tuple[str, str]]:
    """--trace: the timeline's metrics (plait.trace.metrics) and where it was written."""
    t = rec.get("trace")
    if not t:
        return []
    overlap = "-" if t["overlap_ratio"] is None else f"{t['overlap_ratio']:.2f}"
    stall = "-" if t["data_stall"] is None else f"{100 * t['data_stall']:.1f}%"
    slowest = ", ".join(f"rank {r} x{n}" for r, n in t["slowest_rank"].items() if n)
    line = (f"{t['path']}: per step {t['step_ms']:.2f} ms, comm {t['comm_ms']:.2f} ms of "
            f"which exposed {t['exposed_comm_ms']:.2f} ms; overlap {overlap}; data stall "
            f"{stall}")  # fmt: skip
    if t["bubble"] is not None:
        line += f"; measured bubble {t['bubble']:.3f}"
    return [("trace", line), ("slowest rank", slowest or "-")]


def _value(rec: Record) -> str:
    """An evaluation's value in its metric's unit (workload.Metric.unit)."""
    value, unit = rec["value"], rec.get("eval_unit", "")
    if unit == "%":
        return f"{value:.4f} ({value:.2%})"
    if unit == "nats":
        return f"{value:.4f} nats/{rec.get('token') or 'token'}"
    return f"{value:.4f} {unit}".rstrip()


class Text:
    """Plain lines: the header, a line per log point, evaluations, the summary."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def handle(self, kind: str, rec: Record) -> None:
        if kind == "start":
            lines = header(rec)
        elif kind == "log":
            lines = [log_line(rec)]
        elif kind == "eval":
            lines = [eval_line(rec)]
        elif kind == "membership":
            lines = [membership_line(rec)]
        elif kind == "warning":
            lines = [warning_line(rec)]
        elif kind == "finish":
            lines = summary(rec)
        else:
            return
        for line in lines:
            self.text(line)

    def text(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class Bar:
    """A rich progress bar (step, loss, samples/s, time); other lines print above it."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def handle(self, kind: str, rec: Record) -> None:
        if kind == "start":
            for line in header(rec):
                self.text(line)
            self.progress = Progress(
                TextColumn("step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} samples/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=rec["steps"], completed=rec["first_step"], loss="-", speed="-"
            )
            self.progress.start()
        elif self.progress is not None and self.task is not None and kind in (
            "step", "loss", "log",
        ):  # fmt: skip
            fields: dict[str, Any] = {}
            if "loss" in rec:
                fields = {"loss": f"{rec['loss']:.4f}", "speed": f"{rec['samples_per_s']:,.0f}"}
            self.progress.update(self.task, completed=rec["step"], **fields)
        elif kind == "eval":
            self.text(eval_line(rec))
        elif kind == "membership":
            self.text(membership_line(rec))
        elif kind == "warning":
            self.text(warning_line(rec))
        elif kind == "finish":
            self.close()
            for line in summary(rec):
                self.text(line)

    def text(self, line: str) -> None:
        console = self.progress.console if self.progress is not None else self.console
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class Events:
    """Records as lines on `stream`, for the `plait train` process to render.

    `step` records are sent at most every `min_interval` seconds: they only move a bar.
    """

    def __init__(self, stream: TextIO, min_interval: float = 0.1) -> None:
        self.stream = stream
        self.min_interval = min_interval
        self._last_step = 0.0

    def handle(self, kind: str, rec: Record) -> None:
        if kind == "step":
            now = time.monotonic()
            if now - self._last_step < self.min_interval:
                return
            self._last_step = now
        self.stream.write(MARK + json.dumps([kind, rec]) + "\n")
        self.stream.flush()

    def text(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class RankZeroStream(io.TextIOBase):
    """The `stdout` given to the launcher: renders rank 0's events, passes other lines on.

    The launcher writes one whole line per call, prefixed `[rank R] `. Rank 0's lines lose
    their prefix (rank 0 is the job's voice); other ranks' lines keep theirs. An `error`
    record is kept in `self.error` for the caller to report.

    `any_rank` (--elastic): events are rendered from whichever rank sends them, since only
    the current rank 0 does and it need not be the process the launcher calls rank 0.
    """

    def __init__(self, renderer: Renderer, any_rank: bool = False) -> None:
        super().__init__()
        self.renderer = renderer
        self.any_rank = any_rank
        self.error: Record | None = None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        for line in s.splitlines():
            prefix, _, rest = line.partition("] ")
            if self.any_rank and prefix.startswith("[rank ") and rest.startswith(MARK):
                line = RANK0 + rest  # the events of whichever rank is rank 0 now
            if line.startswith(RANK0):
                line = line[len(RANK0) :]
                if line.startswith(MARK):
                    try:
                        kind, rec = json.loads(line[len(MARK) :])
                    except ValueError:
                        self.renderer.text(line)
                        continue
                    if kind == "error":
                        self.error = rec
                    else:
                        self.renderer.handle(kind, rec)
                    continue
            self.renderer.text(line)
        return len(s)


def choose(stream: TextIO, events: bool) -> Renderer:
    """Events for a parent to render, a bar on a terminal, plain lines otherwise."""
    if events:
        return Events(stream)
    if stream.isatty():
        return Bar()
    return Text(stream)

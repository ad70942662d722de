"""`plait plan --calibrate`: fit this machine's overheads (overheads.py) from short real runs.

The profile times each layer alone; a real step pays more (overheads.py). To measure it,
a handful of plans of the request's model run for real, each chosen to move one term of
`Overheads` more than the others:

| run | separates |
|---|---|
| dp1 | compute_scale: a training rank's compute against the profile's, nothing else |
| dp2, dp4 | bucket (the gradient buckets' fixed cost); share (4 ranks on fewer cores) |
| pp2 1f1b m1 and m8 | action and message: 4 actions and 2 sends against 32 and 16 |
| dp2 zero3 | collective: ZeRO-3's per-unit gathers and reduce-scatters |
| tp2 (a model that splits) | collective: tensor parallelism's allreduces |
| ps x2 (a model the server runs) | ps_request: pushes and pulls |

Each is `plait train PLAN --steps STEPS --log-every 1 --eval-every 0 --json` measured as
`plait bench plan` measures (runs.py: the median step after WARMUP, memory per rank), every
rank on one thread (`one_thread`); the
step times go to `fit.fit` (the time terms) and the memories to `fit.fit_memory` (the
bytes every rank holds beyond the model's count, and the margin a plan keeps below a
limit). The result is cached for this machine (`overheads.save`), where every later
`plait plan` and `plait bench plan` predicts with it. Only when every run and the fit
succeed is anything written: a failed run or Ctrl-C leaves the old cache as it was.

Each run's source is "calibrate MODEL: LABEL", so that `plait bench plan` can leave the
calibration's own plans out of the plans it checks the predictions on (`calibrated`).

One model's runs cannot tell every term apart: gpt's steps are all long, so a fixed cost
per step and a compute scale trade off against each other, and a fit to gpt alone
predicted cnn's 8 ms steps at 30 ms. So every calibration's runs are kept beside the cache
(`runs_path`: the plan, the request's model and batch, the measured step and memory), and
calibrating another model fits over its runs and those kept from every other model
calibrated on this machine (`earlier`): the terms then hold for all of them. Calibrating
a model again replaces its own kept runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from plait.plan import runs as measuring
from plait.plan.overheads import Overheads
from plait.plan.plan import SEED, Plan, PlanRequest

if TYPE_CHECKING:  # torch's (the simulator's): imported when a calibration runs
    from plait.plan.fit import Fit

STEPS = 30  # per run: start-up (~8 s a run here) costs far more than mlp's steps
WARMUP = 5  # steps left out of each run's median
WORKERS = 4  # the most ranks a calibration run uses (dp4), all on this machine
MiB = 1 << 20

#: The runs (Space.make's fields over the plain plan), each with what it separates.
PLANS: tuple[tuple[dict[str, Any], str], ...] = (
    ({"shape": (1, 1, 1)}, "compute_scale"),
    ({"shape": (2, 1, 1)}, "bucket"),
    ({"shape": (4, 1, 1)}, "bucket, share"),
    ({"shape": (1, 2, 1), "chunks": 1}, "action, message"),
    ({"shape": (1, 2, 1), "chunks": 8}, "action, message"),
    ({"shape": (2, 1, 1), "zero": 3}, "collective"),
    ({"shape": (1, 1, 2)}, "collective (tensor parallel)"),
    ({"shape": (2, 1, 1), "strategy": "ps"}, "ps_request"),
    # four ranks on the cores, many calls a step: the per-call costs where ranks share cores
    ({"shape": (2, 2, 1), "chunks": 8}, "action, message (4 ranks)"),
    ({"shape": (1, 2, 2), "chunks": 8}, "collective (tensor parallel, 4 ranks)"),
    ({"shape": (2, 2, 1), "chunks": 4, "zero": 3}, "collective (ZeRO 3 per action, 4 ranks)"),
)
PLAIN: dict[str, Any] = {
    "strategy": "allreduce", "zero": 0, "chunks": 1, "schedule": "1f1b", "virtual": 1,
    "checkpointing": False, "precision": "fp32", "compression": "none", "priority": False,
}  # fmt: skip

#: Each term's unit as printed, and the factor from the stored figure to it.
UNITS: dict[str, tuple[str, float]] = {
    "compute_scale": ("x the profile", 1.0),
    "share": ("x per extra rank on a core", 1.0),
    "action": ("ms per pipeline action", 1e3),
    "message": ("ms per send", 1e3),
    "bucket": ("ms per gradient bucket", 1e3),
    "collective": ("ms per collective call", 1e3),
    "ps_request": ("ms per push or pull", 1e3),
    "step_fixed": ("ms per step", 1e3),
    "memory_rank": ("MiB per rank", 1 / MiB),
    "memory_margin": ("% kept below a limit", 100.0),
}


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured, fitted and cached."""

    overheads: Overheads
    fit: Fit  # the time terms: rows (source, predicted before, after, measured)
    memory_rows: tuple[tuple[Any, ...], ...]  # fit_memory's rows (empty: not fitted)
    path: Path  # where the cache was written
    skipped: tuple[str, ...]  # runs the model cannot make, and why
    seconds: float  # the calibration's wall time
    joined: tuple[str, ...] = ()  # the other models whose kept runs the fit took too


def source(what: str, plan: Plan) -> str:
    """A calibration run's name in `Overheads.fitted_from`: "calibrate mlp: dp2"."""
    return f"calibrate {what}: {plan.label()}"


def calibrated(overheads: Overheads | None, what: str) -> set[str]:
    """The labels of the plans of `what` (a model or workload) that `overheads` was
    calibrated on: plans the fit saw, so no fair check of it."""
    head = f"calibrate {what}: "
    found = overheads.fitted_from if overheads is not None else ()
    return {s[len(head) :] for s in found if s.startswith(head)}


def request(req: PlanRequest) -> PlanRequest:
    """The request the calibration runs under: the model and batch of `req`, on this
    machine, up to WORKERS ranks, no limit (what is measured is this machine, not a plan)."""
    return replace(req, workers=WORKERS, hosts=1, link_rate=None, memory_per_rank=None,
                   cores_per_host=None)  # fmt: skip


def choose(space: Any) -> tuple[list[tuple[Plan, str]], list[str]]:
    """The runs a search space (search.Space) can make, with what each separates, and a
    line for each it cannot ("tp2: not a plan of this model")."""
    chosen: list[tuple[Plan, str]] = []
    skipped: list[str] = []
    for changed, why in PLANS:
        plan = space.make({**PLAIN, **changed})
        if space.valid(plan) and plan not in [p for p, _ in chosen]:
            chosen.append((plan, why))
        else:
            skipped.append(f"{plan.label()} ({why}): not a plan this model runs")
    return chosen, skipped


@contextmanager
def one_thread() -> Iterator[None]:
    """The runs started inside with OMP_NUM_THREADS=1 (unless set already).

    The launcher gives each rank one thread when it starts several (launch/env.py), and the
    profile times one thread; a lone `plait train --workers 1` would use every core's,
    another computation than the profile's, and on a busy machine a much slower one (mlp's
    dp1 measured 45 ms a step with 2 threads against 0.94 ms with one, at load average 10).
    """
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def calibrate(
    req: PlanRequest, *, start: measuring.Launch | None = None, steps: int = STEPS,
    warmup: int = WARMUP, out: IO[str] | None = None,
) -> Calibration:  # fmt: skip
    """Run the calibration plans of `req`'s model, fit the overheads, cache them; `start`
    runs each (runs.local: here), `out` takes a line per run (stderr).

    Raises:
        RunFailed: a run failed (the message names its log); nothing is cached.
        ConfigError: a request `plait train` refuses (search.setting).
        ValueError: the fit found nothing to fit (fit.fit); nothing is cached.
    """
    from plait.plan import overheads
    from plait.plan.fit import Observation, fit, fit_memory
    from plait.plan.search import Space, setting

    began = time.perf_counter()
    start = start or measuring.local
    out = out or sys.stderr
    req = request(req)
    s, batch = setting(req, fitted=False)  # the profile alone: what the fit starts from
    chosen, skipped = choose(Space(req, s.profile, batch))
    what = req.workload or req.model or "mlp"
    folder = Path(tempfile.mkdtemp(prefix="plait-calibrate-"))
    for line in skipped:
        print(f"skipped {line}", file=out)
    observations = []
    for i, (plan, why) in enumerate(chosen, 1):
        t0 = time.perf_counter()
        where = folder / f"{i:02d}"
        argv = measuring.train_argv(plan.train_args(), req.train_options(), steps, SEED,
                                    str(where.with_suffix(".json")))  # fmt: skip
        with one_thread():
            figures = measuring.run(argv, start, where)
        step = statistics.median(measuring.step_times(figures, warmup))
        peaks = measuring.memory(figures)
        mem = "" if peaks is None else f", peak {max(peaks) / MiB:.3g} MiB"
        print(f"[{i}/{len(chosen)}] {plan.label()} ({why}): {step * 1e3:.2f} ms/step{mem} "
              f"({time.perf_counter() - t0:.0f} s)", file=out, flush=True)  # fmt: skip
        observations.append(Observation(plan, s, step, None if peaks is None else tuple(peaks),
                                        source(what, plan)))  # fmt: skip
    kept = [r for r in load_runs(req.device) if r["what"] != what]
    others, joined = earlier(kept, req.device, out)
    mine = [_stored(o, what, req) for o in observations]
    observations += others
    time_fit = fit(observations)
    fitted = time_fit.overheads
    if not fitted.fitted_from:
        fitted = replace(fitted, fitted_from=tuple(o.source for o in observations))
    memory_rows: tuple[tuple[Any, ...], ...] = ()
    if any(o.peak_bytes for o in observations):
        rank_bytes, margin, rows = fit_memory(observations)
        fitted = replace(fitted, memory_rank=rank_bytes, memory_margin=margin)
        memory_rows = tuple(tuple(r) for r in rows)
    path = overheads.save(fitted, req.device)
    save_runs([*kept, *mine], req.device)
    return Calibration(fitted, time_fit, memory_rows, path, tuple(skipped),
                       time.perf_counter() - began, joined)  # fmt: skip


def runs_path(device: str = "cpu") -> Path:
    """Where the calibration runs of every model are kept: beside this machine's cache."""
    from plait.plan import overheads

    return overheads.cache_path(device).with_suffix(".runs.json")


def load_runs(device: str = "cpu") -> list[dict[str, Any]]:
    """The kept calibration runs ([] where none, or unreadable: calibrate again)."""
    try:
        data = json.loads(runs_path(device).read_text())
        return [r for r in data["runs"] if {"what", "request", "plan", "step_s"} <= set(r)]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def save_runs(runs: list[dict[str, Any]], device: str = "cpu") -> None:
    """Keep `runs` (atomically)."""
    path = runs_path(device)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "runs": runs}, indent=1))
    os.replace(tmp, path)


def _stored(o: Any, what: str, req: PlanRequest) -> dict[str, Any]:
    """A run as kept: its plan, the request's model, workload and batch, what it measured."""
    asked = {"model": req.model, "workload": req.workload, "batch_size": req.batch_size}
    return {"what": what, "request": asked, "plan": asdict(o.plan), "step_s": o.step_s,
            "peak_bytes": None if o.peak_bytes is None else list(o.peak_bytes),
            "source": o.source}  # fmt: skip


def earlier(
    kept: list[dict[str, Any]], device: str, out: IO[str]
) -> tuple[list[Any], tuple[str, ...]]:
    """The kept runs of other models as observations (each model's setting rebuilt from
    its cached profile), and those models; a model whose setting no longer builds (a
    workload gone) is left out with a line on `out`."""
    from plait.errors import PlaitError
    from plait.plan.fit import Observation
    from plait.plan.search import setting

    found: list[Any] = []
    models: list[str] = []
    settings: dict[str, Any] = {}
    for r in kept:
        what = r["what"]
        if what not in settings:
            try:
                asked = PlanRequest(workers=WORKERS, device=device, **r["request"])
                settings[what] = setting(request(asked), fitted=False)[0]
            except (PlaitError, OSError, ValueError) as e:
                settings[what] = None
                print(f"left out the kept runs of {what}: {e}", file=out)
            else:
                models.append(what)
        if settings[what] is not None:
            peaks = r.get("peak_bytes")
            held = None if peaks is None else tuple(peaks)
            plan = Plan(**r["plan"])
            found.append(Observation(plan, settings[what], float(r["step_s"]), held, r["source"]))
    return found, tuple(models)


def terms(o: Overheads) -> list[tuple[str, str, str]]:
    """(term, value, unit) of every figure of `o` (fields() order)."""
    rows = []
    for f in fields(o):
        value = getattr(o, f.name)
        if f.name in ("fitted_from", "residuals"):
            continue
        unit, scale = UNITS.get(f.name, ("", 1.0))
        rows.append((f.name, f"{value * scale:.4g}", unit))
    return rows


def _table(
    head: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)
) -> list[str]:
    """Columns padded to their widest cell, those in `left` left-aligned, the others right."""
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return [
        "  ".join(cell.ljust(w) if c in left else cell.rjust(w)
                  for c, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        for r in [head, *rows]
    ]  # fmt: skip


def report(c: Calibration) -> str:
    """The fitted terms, each run's prediction before and after the fit against what was
    measured (the residuals), and where the cache is."""
    runs = len(c.overheads.fitted_from)
    lines = [f"plait plan --calibrate: {runs} runs in {c.seconds:.0f} s; the fitted overheads:"]
    if c.joined:
        lines[0] = (f"plait plan --calibrate: {runs} runs in {c.seconds:.0f} s, fitted with the "
                    f"kept runs of {', '.join(c.joined)}; the fitted overheads:")  # fmt: skip
    lines += _table(("term", "value", "unit"), terms(c.overheads), left=(0, 2))
    lines += [
        "",
        "each run's step: predicted from the profile alone (before), with the fitted "
        "overheads (after), and measured; err = (predicted - measured) / measured",
    ]
    rows = [
        (src, f"{before * 1e3:.2f}", f"{after * 1e3:.2f}", f"{meas * 1e3:.2f}",
         f"{100 * (before - meas) / meas:+.1f}%", f"{100 * (after - meas) / meas:+.1f}%")
        for src, before, after, meas in c.fit.rows
    ]  # fmt: skip
    head = ("run", "before ms", "after ms", "measured ms", "err before", "err after")
    lines += _table(head, rows)
    errors = [abs(after - meas) / meas for _, _, after, meas in c.fit.rows]
    if errors:
        lines.append(f"mean absolute error after the fit: {100 * statistics.mean(errors):.1f}%")
    if c.memory_rows:
        lines += [
            "",
            "each run's largest rank: predicted with the fitted bytes per rank, and "
            "measured (the margin covers the largest under-prediction, at least 5%)",
        ]
        mem = [(str(src), f"{pred / MiB:.2f}", f"{meas / MiB:.2f}",
                f"{100 * (pred - meas) / meas:+.1f}%" if meas else "")
               for src, pred, meas in c.memory_rows]  # fmt: skip
        lines += _table(("run", "predicted MiB", "measured MiB", "err"), mem)
    else:
        lines += ["", "memory: not fitted (no run reported its memory per rank)"]
    lines += [f"skipped {s}" for s in c.skipped]
    lines.append(f"cached: {c.path} (plait plan and plait bench plan predict with it; "
                 "plait plan --no-overheads without)")  # fmt: skip
    return "\n".join(lines)

"""What composes in `plait train`: the cells of its option matrix and each one's expected
verdict, one source for the test (tests/unit/test_matrix.py, tests/world/test_matrix_runs.py),
`plait bench matrix` (every cell run) and docs/matrix.md (train/matrix_page.py).

A cell is a base (a strategy and a mesh shape: `BASES`) with up to two options on top
(`OPTIONS`; two only for the axis pairs of `PAIRS`, where the options act on the same
thing). Its verdict is either "trains", with its reference cell (the same cell without one
option) and the tolerance its losses keep from the reference's, or "refused", with the
stable part of the one-line reason TrainConfig gives: the first rule of `REFUSED` that
matches it. The rules were read off the real checks (train/config.py and the strategies'
rows) by running them on every cell, and the test runs them again: a cell that starts to
train, or to be refused, fails it until its rule here changes. Each rule is one line, so a
combination built is one line deleted. A cell the checks accept but whose run fails, or
whose option changes nothing, is a defect, named by a rule of `DEFECTS` the same way.

The model is the smallest built-in GPT (gpt-small: 2 blocks, 4 heads) on synthetic text
(--tp splits a transformer only), 3 steps of a global batch of 8: AdamW's state acts from the
second step on. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.options import flag

#: what every cell trains (a cell's base and options add to it)
RUN: dict[str, Any] = {"model": "gpt-small", "data": "synthetic", "steps": 3,
                       "batch_size": 8, "eval_every": 0, "log_every": 3}  # fmt: skip
STOP_AFTER = 2  # a checkpoint cell: stopped after this step (its checkpoint), then resumed
MESH = 1e-4  # a mesh or ZeRO against dp alone: the same sums in another order (fp32)
UNORDERED = 0.3  # async and ssp: the held-out loss after the same updates in another order
EVAL = " (held-out)"  # a cell's name + EVAL: its held-out loss at the end, for an unordered one


@dataclass(frozen=True, eq=False)
class Base:
    """A strategy on a mesh shape: the row a cell's options are added to."""

    name: str
    options: dict[str, Any]
    reference: str | None = None  # the base it must train like (None: a root)
    tolerance: float = 0.0  # its losses' largest difference from the reference's
    # False: its workers claim the steps' slices as they come (--ps-mode async, ssp), so
    # worker 0 reports a loss for each slice it claimed (none, if the other was quicker), of
    # other data from run to run: runs on it are compared by the held-out loss at the end
    # (every slice trained; `EVAL`), within the base's tolerance at least
    ordered: bool = True


@dataclass(frozen=True, eq=False)
class Option:
    """One option value added to a base: `plait train`'s options for it, and how far its
    losses may be from the same cell without it (0: bit for bit)."""

    name: str  # as a cell's name shows it, e.g. "zero 2"
    axis: str  # one value per axis in a cell: zero, schedule, precision, wire, ...
    options: dict[str, Any]
    tolerance: float
    why: str  # the reason for the tolerance (docs/matrix.md)
    lossy: bool = False  # it rounds: its losses must differ from the reference's (not ignored)
    slow: bool = False  # its run costs far more than a step (torch.compile): not in the suite


BASES: dict[str, Base] = {b.name: b for b in (
    Base("dp4", {"workers": 4}),
    Base("dp2 pp2", {"workers": 4, "pp": 2}, "dp4", MESH),
    Base("dp2 tp2", {"workers": 4, "tp": 2}, "dp4", MESH),
    Base("pp2 tp2", {"workers": 4, "pp": 2, "tp": 2}, "dp4", MESH),
    # the parameter server: 2 workers, 1 server; async and ssp let workers run apart
    Base("ps sync", {"workers": 2, "strategy": "ps", "servers": 1}),
    Base("ps async", {"workers": 2, "strategy": "ps", "servers": 1, "ps_mode": "async"},
         "ps sync", UNORDERED, ordered=False),
    Base("ps ssp", {"workers": 2, "strategy": "ps", "servers": 1, "ps_mode": "ssp"},
         "ps sync", UNORDERED, ordered=False),
)}  # fmt: skip

EXACT = "the same arithmetic"
LOW = 0.03  # a low-precision cell: autocast's or the wire's rounding over 3 steps
CODEC = 0.3  # top-k or PowerSGD: most of a step's gradient held back (error feedback)
OPTIONS: dict[str, Option] = {o.name: o for o in (
    *(Option(f"zero {s}", "zero", {"zero": s}, MESH, "reduce-scatter: the sums in another "
             "order") for s in (1, 2, 3)),
    *(Option(s, "schedule", {"schedule": s}, MESH, "micro-batch gradients summed in another "
             "order") for s in ("gpipe", "interleaved", "zb-h1")),
    *(Option(p, "precision", {"precision": p}, LOW, "autocast's rounding", lossy=True)
      for p in ("bf16", "fp16")),
    Option("reduce bf16", "wire", {"reduce_dtype": "bf16"}, LOW, "the average's rounding",
           lossy=True),
    Option("fp16 wire", "wire", {"compression": "fp16"}, LOW, "the average's rounding",
           lossy=True),
    Option("topk", "wire", {"compression": "topk:0.1"}, CODEC, "a tenth sent, the rest fed "
           "back", lossy=True),
    Option("powersgd", "wire", {"compression": "powersgd:2"}, CODEC, "rank 2, the rest fed "
           "back", lossy=True),
    Option("priority", "priority", {"priority": True}, MESH, "the gradient reduced in "
           "slices: the sums in another order"),
    Option("ac", "ac", {"activation_checkpointing": True}, 0.0, EXACT + ", again in "
           "backward"),
    Option("compile", "compile", {"compile": True}, MESH, "fused kernels", slow=True),
    Option("checkpoint", "checkpoint", {"out": "{out}", "checkpoint_every": STOP_AFTER},
           0.0, f"stopped after step {STOP_AFTER}, then --resume: the uninterrupted run"),
)}  # fmt: skip
PP_ONLY = ("schedule",)  # axes that mean something only with --pp

# The axis pairs whose options act on the same thing (a cell with two options): how the
# gradients are reduced and sharded, what a schedule runs, what a checkpoint holds.
PAIRS: dict[tuple[str, str], tuple[str, ...]] = {
    # (axis, axis): the option names of the second axis in these pairs (all of the first's)
    ("zero", "precision"): ("bf16", "fp16"),
    ("zero", "wire"): ("reduce bf16", "powersgd"),
    ("zero", "priority"): ("priority",),
    ("zero", "ac"): ("ac",),
    ("zero", "compile"): ("compile",),
    ("zero", "checkpoint"): ("checkpoint",),
    ("schedule", "zero"): ("zero 1", "zero 3"),
    ("schedule", "precision"): ("bf16", "fp16"),
    ("schedule", "ac"): ("ac",),
    ("schedule", "compile"): ("compile",),
    ("priority", "precision"): ("bf16", "fp16"),
    ("priority", "compile"): ("compile",),
    ("priority", "wire"): ("reduce bf16", "powersgd"),
    ("precision", "wire"): ("reduce bf16", "powersgd"),
    ("precision", "ac"): ("ac",),
    ("precision", "checkpoint"): ("checkpoint",),
}


@dataclass(frozen=True)
class Cell:
    """A base with options on top: one `plait train` run."""

    base: Base
    extra: tuple[Option, ...] = ()

    @property
    def name(self) -> str:
        return " + ".join([self.base.name, *(o.name for o in self.extra)])

    def options(self, out: str = "OUT") -> dict[str, Any]:
        """`plait train`'s options by name (`out`: the checkpoint cell's --out DIR)."""
        found = {**RUN, **self.base.options}
        for o in self.extra:
            found.update({k: out if v == "{out}" else v for k, v in o.options.items()})
        return found

    def argv(self, out: str = "OUT") -> list[str]:
        """The options as `plait train`'s command line."""
        words = []
        for name, value in self.options(out).items():
            if value is True:
                words.append(flag(name))
            elif value is not False:
                words += [flag(name), str(value)]
        return words

    def has(self, axis: str, *names: str) -> bool:
        """Whether an option of `axis` is on (one of `names`, when given)."""
        return any(o.axis == axis and (not names or o.name in names) for o in self.extra)

    @property
    def ps(self) -> bool:
        return self.base.options.get("strategy") == "ps"

    @property
    def mesh(self) -> bool:
        return self.pp or self.tp

    @property
    def pp(self) -> bool:
        return self.base.options.get("pp", 1) > 1

    @property
    def tp(self) -> bool:
        return self.base.options.get("tp", 1) > 1

    @property
    def checkpoint(self) -> bool:
        return self.has("checkpoint")

    @property
    def slow(self) -> bool:
        return any(o.slow for o in self.extra)

    def reference(self) -> tuple[Cell | None, float]:
        """The cell this one must train like, and the tolerance: without its option of least
        tolerance (an exact one first: the sharpest check), looser if the cell keeps a
        lossy option, whose rounding the difference carries; a base, its base's."""
        if not self.extra:
            ref = self.base.reference
            return (Cell(BASES[ref]) if ref else None), self.base.tolerance
        drop = min(reversed(self.extra), key=lambda o: o.tolerance)
        kept = tuple(o for o in self.extra if o is not drop)
        tol = drop.tolerance
        if tol > 0:
            tol = max([tol, *(o.tolerance for o in kept if o.lossy)])
        if not self.base.ordered:
            tol = max(tol, self.base.tolerance)
        return Cell(self.base, kept), tol


def cells() -> list[Cell]:
    """Every cell: each base alone, with each option, and with each pair of `PAIRS` whose
    two options each train alone on the base (the others would repeat a refusal)."""
    found = []
    for base in BASES.values():
        on_pp = base.options.get("pp", 1) > 1
        usable = [o for o in OPTIONS.values() if on_pp or o.axis not in PP_ONLY]
        alone = [Cell(base, (o,)) for o in usable]
        found += [Cell(base), *alone]
        trains = [c.extra[0] for c in alone if verdict(c) is None]
        for (first, _), names in PAIRS.items():
            for a in (o for o in usable if o.axis == first and o in trains):
                found += [Cell(base, (a, OPTIONS[n])) for n in names if OPTIONS[n] in trains]
    return found


# ----------------------------------------------------------------------- the verdicts
@dataclass(frozen=True)
class Refused:
    """A rule: the cells it matches are refused with `reason` in the error's one line."""

    name: str  # what is refused, as docs/matrix.md names it
    matches: Callable[[Cell], bool]
    reason: str  # a stable part of the message TrainConfig gives
    building: bool = False  # issue 34 builds it: flip by deleting the line


def _sched(c: Cell, *names: str) -> bool:
    return c.pp and c.has("schedule", *names)


def _dp1(c: Cell) -> bool:
    """No data-parallel axis: dp = workers / (pp * tp) = 1."""
    o = c.base.options
    return not c.ps and o["workers"] == o.get("pp", 1) * o.get("tp", 1)


# In the order TrainConfig checks (train/config.py's __post_init__): the first that matches
# gives the cell's message.
REFUSED: list[Refused] = [
    Refused("--zero with --strategy ps", lambda c: c.ps and c.has("zero"),
            "shards data parallelism: it runs with --strategy allreduce, not ps"),
    Refused("fp16 with --strategy ps", lambda c: c.ps and c.has("precision", "fp16"),
            "--precision fp16 is not supported with --strategy ps"),
    Refused("--priority with --strategy ps and --compile",
            lambda c: c.ps and c.has("priority") and c.has("compile"),
            "--priority with --strategy ps waits for each layer's values"),
    Refused("--priority with --zero", lambda c: not c.ps and c.has("priority") and c.has(
            "zero"), "its slices and per-layer steps are DataParallel's allreduce"),
    Refused("--priority on a mesh", lambda c: not c.ps and c.has("priority") and c.mesh,
            "--priority schedules DataParallel's reduction"),
    Refused("--priority with compression", lambda c: not c.ps and c.has("priority") and
            c.has("wire"), "--priority schedules DataParallel's reduction"),
    Refused("--zero with top-k or PowerSGD", lambda c: c.has("zero") and (
            c.has("wire", "topk") or c.has("wire", "powersgd")), "does not run with --zero"),
    Refused("--compile with --tp", lambda c: c.tp and c.has("compile"),
            "torch.compile cannot trace the tensor-parallel layers"),
    Refused("compression with --strategy ps", lambda c: c.ps and c.has("wire"),
            "under --strategy ps they do not average them"),
    Refused("compression with dp 1", lambda c: _dp1(c) and c.has("wire"),
            "changes nothing at dp 1: no data-parallel ranks average a gradient"),
]  # fmt: skip


@dataclass(frozen=True)
class Defect:
    """A rule: the cells it matches are accepted, but their run `fails`, or the option
    that makes them is `ignored` (its losses are its reference's): defects, named, each a
    line to delete when fixed (`plait bench matrix` fails on a cell that stops failing or
    being ignored)."""

    name: str
    matches: Callable[[Cell], bool]
    why: str
    kind: str  # "fails" or "ignored"
    axis: str = ""  # ignored: the axis whose option changes nothing


DEFECTS: list[Defect] = []


def defect(cell: Cell) -> Defect | None:
    """The defect of a cell the checks accept, or None (a refused cell has none)."""
    if verdict(cell) is not None:
        return None
    return next((d for d in DEFECTS if d.matches(cell)), None)


def verdict(cell: Cell) -> Refused | None:
    """The rule that refuses `cell`, or None: it trains."""
    return next((r for r in REFUSED if r.matches(cell)), None)


# ----------------------------------------------------------------- comparing two runs
def difference(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest absolute difference of two runs' losses, step by step (inf when a run
    has another number of steps or a loss that is not finite)."""
    if len(losses) != len(reference) or not all(map(math.isfinite, [*losses, *reference])):
        return math.inf
    return max((abs(a - b) for a, b in zip(losses, reference, strict=True)), default=0.0)


def judge(cell: Cell, losses: Sequence[float], reference: Sequence[float] | None) -> str | None:
    """What is wrong with a trained cell's losses against its reference's (None: nothing)."""
    steps = RUN["steps"] if cell.base.ordered else 1  # (unordered: the held-out loss)
    if len(losses) != steps:
        return f"{len(losses)} losses, not {steps}"
    if not all(map(math.isfinite, losses)):
        return f"a loss that is not finite: {list(losses)}"
    if reference is None:
        return None
    _, tol = cell.reference()
    diff = difference(losses, reference)
    if diff > tol:
        return f"losses {diff:.3g} from the reference's > tolerance {tol:g}"
    ref, _ = cell.reference()
    gone = [o for o in cell.extra if ref is None or o not in ref.extra]
    ignored = defect(cell)
    if (
        ignored is not None
        and ignored.kind == "ignored"
        and any(o.axis == ignored.axis for o in gone)
    ):
        if list(losses) != list(reference):
            return f"listed ignored ({ignored.name}) but its losses moved: delete its line"
    elif any(o.lossy for o in gone) and list(losses) == list(reference):
        return f"{', '.join(o.name for o in gone)} changed no loss: ignored?"
    return None


@dataclass
class Tally:
    """How many cells have each verdict."""

    trains: int = 0
    refused: int = 0
    broken: int = 0  # accepted, but their run fails or an option is ignored (DEFECTS)
    by_rule: dict[str, int] = field(default_factory=dict)


def tally(found: Sequence[Cell] | None = None) -> Tally:
    t = Tally()
    for c in cells() if found is None else found:
        rule = verdict(c)
        if rule is None:
            if defect(c) is not None:
                t.broken += 1
            else:
                t.trains += 1
        else:
            t.refused += 1
            t.by_rule[rule.name] = t.by_rule.get(rule.name, 0) + 1
    return t


def configured(cell: Cell, out: str) -> str | None:
    """What the real checks say of `cell` (job.configure, as `plait train` runs it before
    any worker starts): the error's message, or None when it would start. `out`: an empty
    directory for the checkpoint cell's --out."""
    from plait.train import job
    from plait.train.errors import CheckpointError, ConfigError, MissingExtraError

    try:
        job.configure(cell.options(out))
    except (ConfigError, MissingExtraError, CheckpointError) as e:
        return str(e)
    return None

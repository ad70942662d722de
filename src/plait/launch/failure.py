"""Explaining a failed job: which rank caused it, how, and who reported it.

When one rank dies or freezes, the others raise `PeerFailureError` naming it and exit
first, so the first rank the launcher sees fail is usually a reporter, not the culprit.
`explain` decides from evidence instead: each rank's exit code, whether it exited before
the launcher stopped it, and the `PeerFailureError: rank N failed: REASON` lines in its
stderr. It is pure (facts in, text out) so that every case is tested without processes.

Words: a rank "failed on its own" when it was killed, exited non-zero or raised before the
launcher stopped it (or raised, and the stop cut its exit short); a "reporter" is a rank
whose error is a `PeerFailureError` about another; a rank is "frozen" when reporters name
it and it was still running when the launcher stopped the job (SIGSTOP, a hung host).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

RULE = "=" * 72  # between the ranks' streamed lines and the launcher's summary
_SUBRULE = "-" * 72  # before each traceback, when there are several

# errors.PeerFailureError's message: "rank N failed: REASON[ (seen by rank S)]. The job ..."
_PEER_FAILURE = re.compile(
    r"PeerFailureError: rank (\d+) failed: (.*?)(?: \(seen by rank (\d+)\))?"
    r"(?:\. The job cannot continue.*|\.)?$"
)
_TRACEBACK = "Traceback (most recent call last):"
# torch.distributed's excepthook prefixes each line of an uncaught error's traceback so
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")
# liveness.py's heartbeat reason ends in this explanation; the summary says it in its words
_EXPLAINED = " (process frozen or host unreachable)"


@dataclass(frozen=True)
class RankFacts:
    """What the launcher knows about one rank once the job is gone.

    Attributes:
        rank: its global rank.
        name: how messages name it ("rank 2", "rank 5 (server 1)").
        code: its `Popen.returncode` (negative: killed by that signal).
        exited_at: when its exit was first seen, in seconds after the first failure seen
            (0.0 for that rank); None if it was still running when the launcher stopped it.
        stopped: the launcher's stop signal reached it while it was running, so a signal in
            `code` (or an exit the signal caused) is the launcher's doing, not its own.
        tail: its last stderr lines, each ending in a newline.
    """

    rank: int
    name: str
    code: int
    exited_at: float | None
    stopped: bool
    tail: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """The launcher's account of a failed job.

    Attributes:
        text: what to print after the job is gone: the culprit first, then who reported it,
            then the tracebacks of ranks that raised their own errors.
        status: the job's exit status (128 + N for a culprit killed by signal N).
        culprit: the global rank blamed.
    """

    text: str
    status: int
    culprit: int


def exit_status(returncode: int) -> int:
    """Map a `Popen.returncode` to a shell exit status: `-N` (killed by signal N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """Say how a process ended, e.g. "exit code 1" or "killed by SIGKILL"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}"


@dataclass(frozen=True)
class _Seen:
    """One rank's reading of its stderr tail."""

    error: str | None  # its last exception, "ValueError: boom" (first line, short type name)
    accused: int | None  # the rank its PeerFailureError names
    reason: str  # and why
    seen_by: int | None  # the rank that noticed first, when it was told by another


def _read(tail: Sequence[str]) -> _Seen:
    tail = [_TORCH_PREFIX.sub("", line) for line in tail]
    error = None
    starts = [i for i, line in enumerate(tail) if line.startswith(_TRACEBACK)]
    if starts:  # the exception line is the first unindented one after the last traceback
        for line in tail[starts[-1] + 1 :]:
            if line.strip() and not line[0].isspace():
                kind, sep, message = line.rstrip("\n").partition(": ")
                error = kind.rpartition(".")[2] + sep + message
                break
    for line in reversed(tail):
        m = _PEER_FAILURE.search(line.rstrip("\n"))
        if m:
            seen_by = int(m[3]) if m[3] is not None else None
            return _Seen(error, int(m[1]), m[2], seen_by)
    return _Seen(error, None, "", None)


def _is_report(seen: _Seen) -> bool:
    """Whether the rank's own story is a peer's failure (it raised, or printed, that)."""
    if seen.accused is None:
        return False
    return seen.error is None or seen.error.startswith("PeerFailureError")


def _own_code(fact: RankFacts, seen: _Seen) -> int:
    """Its exit code, unless the launcher's stop decided it: a raiser cut short counts 1."""
    if fact.stopped and fact.code < 0 and seen.error is not None:
        return 1  # it raised, and our stop signal cut its exit (its goodbye to peers) short
    return fact.code


def _failed_alone(fact: RankFacts, seen: _Seen) -> bool:
    """It failed before, or regardless of, the launcher stopping it (reports excluded)."""
    if fact.code == 0 or _is_report(seen):
        return False
    return not fact.stopped or seen.error is not None


def _ranks_word(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _short(reason: str) -> str:
    return reason[: -len(_EXPLAINED)] if reason.endswith(_EXPLAINED) else reason


def _headline(fact: RankFacts, seen: _Seen, reason: str | None) -> str:
    """How `fact`'s rank ended, in one line; `reason`: what reporters said about it."""
    if not _failed_alone(fact, seen) and reason is not None:
        if fact.exited_at is None or fact.stopped:
            how = "stopped responding" if "heartbeat" in reason else "was reported failed"
            return f"{fact.name} {how} ({_short(reason)}); the launcher stopped it"
        if fact.code == 0:
            return f"{fact.name} exited (exit code 0) while its peers still needed it"
    code = _own_code(fact, seen)
    if seen.error is not None:
        return f"{fact.name} raised {seen.error} ({describe_exit(code)})"
    if code < 0:
        return f"{fact.name} was {describe_exit(code)}"
    return f"{fact.name} exited with code {code}"


def _traceback(fact: RankFacts, seen: _Seen) -> str:
    lines = "".join(fact.tail) or f"({fact.name} wrote nothing on stderr)\n"
    head = f"plait run: {fact.name} failed ({describe_exit(_own_code(fact, seen))}); its traceback:"
    return f"{head}\n{lines}"


def explain(facts: Sequence[RankFacts]) -> Report:
    """Explain a failed job from its ranks' facts: culprit, its reporters, tracebacks.

    The culprit is the first rank (by exit time) that failed on its own; failing that, the
    rank most reporters name (frozen: still running when the others gave up; or on another
    node); failing that, the first rank that exited non-zero. The status is the culprit's
    exit status, or, when it has none of its own (frozen, elsewhere), the first failed
    rank's.

    Raises:
        ValueError: no rank failed (nothing to explain).
    """
    seen = {f.rank: _read(f.tail) for f in facts}
    by_rank = {f.rank: f for f in facts}
    failed = sorted((f for f in facts if f.code != 0),
                    key=lambda f: (f.exited_at is None, f.exited_at or 0.0, f.rank))  # fmt: skip
    if not failed:
        raise ValueError("no rank failed: there is nothing to explain")
    alone = [f for f in failed if _failed_alone(f, seen[f.rank])]
    accusations: dict[int, list[int]] = {}
    for f in facts:
        s = seen[f.rank]
        if _is_report(s) and s.accused is not None:
            accusations.setdefault(s.accused, []).append(f.rank)
    if alone:
        culprit = alone[0].rank
    elif accusations:  # the most named; among ties the lowest rank
        culprit = min(accusations, key=lambda r: (-len(accusations[r]), r))
    else:
        culprit = failed[0].rank
    reporters = sorted(accusations.get(culprit, ()))
    reasons = [seen[r].reason for r in reporters]
    reason = max(set(reasons), key=reasons.count) if reasons else None

    lines = [RULE]
    if culprit in by_rank:
        fact = by_rank[culprit]
        lines.append("plait run: " + _headline(fact, seen[culprit], reason))
        status = exit_status(_own_code(fact, seen[culprit]))
        if not _failed_alone(fact, seen[culprit]) and fact.code <= 0:
            status = exit_status(failed[0].code)  # frozen: our SIGKILL is not its status
    else:
        where = f"rank {culprit} (not on this node) failed"
        lines.append(f"plait run: {where}: {_short(reason or 'reason unknown')}")
        status = exit_status(failed[0].code)
    for other in alone[1:]:  # several ranks failed on their own: each is part of the story
        lines.append("plait run: also, " + _headline(other, seen[other.rank], None))
    lines.extend(_reporter_lines(reporters, seen))
    raisers = [f for f in alone if seen[f.rank].error is not None]
    for f in raisers:
        if len(raisers) > 1:
            lines.append(_SUBRULE)
        lines.append(_traceback(f, seen[f.rank]).rstrip("\n"))
    return Report("\n".join(lines) + "\n", status, culprit)


def _reporter_lines(reporters: Sequence[int], seen: dict[int, _Seen]) -> list[str]:
    """One line per distinct reason: "  ranks 0, 1 saw it: no heartbeat for 8.0 s"."""
    groups: dict[str, list[int]] = {}
    for r in reporters:
        groups.setdefault(_short(seen[r].reason), []).append(r)
    lines = []
    for reason, ranks in groups.items():
        # the first rank to notice tells the others, whose errors then say "seen by rank S"
        seers = {s for r in ranks if (s := seen[r].seen_by) is not None} - set(ranks)
        told = f" (first seen by {_ranks_word(sorted(seers))})" if seers else ""
        lines.append(f"  {_ranks_word(ranks)} saw it: {reason}{told}")
    return lines

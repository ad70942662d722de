"""What the Communicator's world checks share: exact inputs, the one-process references, and
the checks one rank collects, by section, for the parent to assert (tests/world/test_comm.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
OPS = ["sum", "avg", "min", "max", "prod"]
ALLREDUCE = ["auto", "native", "ring", "halving_doubling", "tree"]
BROADCAST = ["auto", "native", "tree"]  # also reduce's
GATHER = ["auto", "native", "ring"]  # allgather's and reduce_scatter's
f32, i64 = torch.float32, torch.int64

Fingerprint = tuple[str, tuple[int, ...], bytes]


def ints(shape: tuple[int, ...], dtype: torch.dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s input for case `seed`: integers in -2..2 (exact in every dtype)."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def every(p: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    return [ints(shape, dtype, seed, q) for q in range(p)]


def reduced(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The single-process reference of a reduction over ranks; avg of ints rounds toward
    zero (Horovod's rule)."""
    x = torch.stack(xs)
    if op in ("sum", "avg"):
        out = x.sum(0, dtype=x.dtype)
        if op == "avg":
            trunc = None if out.is_floating_point() else "trunc"
            out = out.div(len(xs), rounding_mode=trunc)
        return out
    if op == "prod":
        return x.prod(0, dtype=x.dtype)
    return x.amin(0) if op == "min" else x.amax(0)


def fingerprint(t: torch.Tensor) -> Fingerprint:
    return (
        str(t.dtype),
        tuple(t.shape),
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


class Checks:
    """One rank's failed checks and the results every rank of a communicator must share, kept
    by section (`begin`) so that a failure names the part of the battery that broke."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.scope = ""  # prefixes shared keys: results of a sub-communicator
        self.seed = 0  # runs on across sections: each case draws the inputs it always drew
        self.section = ""
        self.failures: dict[str, list[str]] = {}
        self.shared: dict[str, dict[str, Fingerprint]] = {}

    def begin(self, section: str) -> None:
        """The checks from here on belong to `section`."""
        self.section = section
        self.failures[section] = []
        self.shared[section] = {}

    def next(self) -> int:
        self.seed += 1
        return self.seed

    def fail(self, text: str) -> None:
        self.failures[self.section].append(f"{self.scope}{text}")

    def share(self, name: str, got: torch.Tensor) -> None:
        self.shared[self.section][self.scope + name] = fingerprint(got)

    def equal(self, name: str, got: object, want: torch.Tensor, share: bool = True) -> None:
        """Exactly `want`: same dtype, shape and values."""
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got, want)
        )
        if not ok:
            self.fail(f"{name}: got {got!r}, want {want!r}")
        if share and isinstance(got, torch.Tensor):
            self.share(name, got)

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        except AssertionError as e:
            self.fail(f"{name}: {e}")
        self.share(name, got)

    def true(self, name: str, cond: bool, detail: object = "") -> None:
        if not cond:
            self.fail(f"{name} {detail}")


def check_rooted(ck: Checks, name: str, got: object, want: torch.Tensor | None) -> None:
    """A rooted collective's answer: `want` on the root, None (want is None) elsewhere."""
    if want is None:
        ck.true(f"{name}: None off the root", got is None, got)
    else:
        ck.equal(name, got, want, share=False)


Report = tuple[dict[str, list[str]], dict[str, dict[str, Fingerprint]]]  # Checks' two dicts


def assert_section(reports: list[Report], section: str) -> None:
    """Every rank passed `section`'s checks, and the ranks agree bit for bit on its results."""
    failed = [
        f"rank {rank}: {len(failures[section])} checks failed:\n"
        + "\n".join(failures[section][:30])
        for rank, (failures, _) in enumerate(reports)
        if failures[section]
    ]
    assert not failed, "\n".join(failed)
    by_key: dict[str, dict[int, Fingerprint]] = defaultdict(dict)
    for rank, (_, shared) in enumerate(reports):
        for key, fp in shared[section].items():
            by_key[key][rank] = fp
    diverged = [f"{k} (ranks {sorted(v)})" for k, v in by_key.items() if len(set(v.values())) > 1]
    assert not diverged, f"ranks disagree on: {diverged}"

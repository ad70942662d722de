"""The component of `TrainConfig` for `plait train --elastic` (train/elastic.py runs it):
whether the run goes on when workers die or join, between how many workers, and what stays
when their number changes (the global batch policy, plait.elastic.batch_policy). What it
does not run with yet is refused by TrainConfig (config.py), which knows the strategy and
the mesh. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plait.elastic.batch_policy import GLOBAL, PER_RANK, POLICIES, BatchPolicy
from plait.options import flag, option
from plait.train.errors import ConfigError

#: The options that mean something only with --elastic.
ELASTIC_ONLY = ("min_workers", "max_workers", "batch_policy")


@dataclass(kw_only=True)
class ElasticConfig:
    """Elastic training: None means "decided by --workers" and is filled in on creation.
    A rank started by a launcher (plait run) has its bounds set back to None: the
    launcher's --min-np and --max-np decide them (job.configure)."""

    elastic: bool = field(
        default=False,
        metadata=option(
            "keep training when a worker dies: the others re-form the job, take the last "
            "step's state from a live peer (in memory, not from disk) and redo the step in "
            "flight; no sample is skipped or repeated (docs/elastic.md). --strategy "
            "allreduce (--zero too), not with --pp, --tp or --priority"
        ),
    )
    min_workers: int | None = field(
        default=None,
        metadata=option(
            "with --elastic: stop the run when fewer than N workers are left",
            metavar="N",
            default_text="1",
        ),
    )
    max_workers: int | None = field(
        default=None,
        metadata=option(
            "with --elastic: the most workers the run takes as processes join",
            metavar="M",
            default_text="--workers",
        ),
    )
    batch_policy: str = field(
        default=GLOBAL,
        metadata=option(
            "with --elastic: what stays when the number of workers changes: global (the "
            "global batch; each worker's share of it changes) or per-rank (each worker's "
            "batch, --batch-size / --workers; the learning rate is scaled by workers / "
            "--workers, the linear scaling rule)",
            choices=POLICIES,
        ),
    )

    def __post_init__(self) -> None:
        if self.batch_policy not in POLICIES:
            raise ConfigError(
                f"--batch-policy {self.batch_policy!r} is not one of {', '.join(POLICIES)}"
            )
        for name in ("min_workers", "max_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} {value} < 1: a run needs at least one worker")
        if not self.elastic:
            given = [flag(n) for n in ELASTIC_ONLY if getattr(self, n) not in (None, GLOBAL)]
            if given:
                raise _without_elastic(given)

    def filled(self, workers: int) -> ElasticConfig:
        """The bounds checked against the run's `workers` (the starting membership) and
        filled in: at least 1 and at most `workers` to start with.

        Raises:
            ConfigError: min_workers > workers or max_workers < workers, with both values.
        """
        if not self.elastic:
            return self
        low = 1 if self.min_workers is None else self.min_workers
        high = workers if self.max_workers is None else self.max_workers
        if low > workers:
            raise ConfigError(
                f"--min-workers {low} > --workers {workers}: the run would stop before it "
                f"started; give --min-workers between 1 and {workers}"
            )
        if high < workers:
            raise ConfigError(
                f"--max-workers {high} < --workers {workers}: the run starts with {workers}; "
                f"give --max-workers of at least {workers}"
            )
        return replace(self, min_workers=low, max_workers=high)

    def policy(self, batch_size: int, workers: int) -> BatchPolicy:
        """The run's batch policy: --batch-size is the global batch at `workers` (the
        starting workers); under per-rank each worker keeps batch_size / workers."""
        per_rank = self.batch_policy == PER_RANK
        batch = batch_size // workers if per_rank else batch_size
        return BatchPolicy(batch=batch, fixed=self.batch_policy, base_workers=workers)

    @staticmethod
    def check_given(options: dict[str, Any]) -> None:
        """Refuse --min-workers, --max-workers and --batch-policy without --elastic, by what
        the user gave (see config.check_given): `--batch-policy global` too.

        Raises:
            ConfigError: naming the flags given in vain.
        """
        given = [flag(n) for n in ELASTIC_ONLY if options.get(n) is not None]
        if given and not options.get("elastic"):
            raise _without_elastic(given)


def _without_elastic(given: list[str]) -> ConfigError:
    verb = "applies" if len(given) == 1 else "apply"
    return ConfigError(f"{', '.join(given)} {verb} to elastic runs only: add --elastic")

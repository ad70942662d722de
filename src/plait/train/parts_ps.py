"""The parameter server's component as `plait train` takes it: which of `plait.ps.PSConfig`'s
fields its command line shows, how many servers by default, and the checks of those fields
(the config itself, and its defaults, live only in plait.ps). No torch here.
"""

from __future__ import annotations

from typing import Any

from plait.options import flag, flatten
from plait.ps.config import PSConfig
from plait.train.errors import ConfigError

# PSConfig's fields on plait train's command line (the rest follow the recipe: TrainConfig)
PS_OPTIONS = ("mode", "staleness", "stale_policy", "warm_start_steps", "worker_timeout_s")
DEFAULT_SERVERS = 2


def check(ps: PSConfig) -> None:
    """A config's values as a run takes them: in sync mode nothing is stale (a worker's
    timeout applies in every mode: a silent worker fails a sync job, naming it).

    Raises:
        ConfigError: an option of the async modes set in sync mode.
    """
    if ps.mode != "sync":
        return
    if ps.staleness != PSConfig.staleness:
        raise ConfigError(
            f"--staleness {ps.staleness} applies to --ps-mode ssp (the bound on how "
            "far a worker may run ahead) or async (the bound of --stale-policy drop), "
            "not --ps-mode sync"
        )
    if ps.stale_policy != "accept" or ps.warm_start_steps:
        raise ConfigError(
            "--stale-policy and --warm-start-steps apply to --ps-mode async or ssp: in "
            "sync mode no gradient is stale"
        )


def given(servers: int | None, ps: PSConfig | None) -> list[str]:
    """The flags of parameter-server options set away from their defaults."""
    found = ["--servers"] if servers is not None else []
    if ps is not None:
        defaults = flatten(PSConfig(), PS_OPTIONS)
        mine = flatten(ps, PS_OPTIONS)
        found += [flag(n) for n in defaults if mine[n] != defaults[n]] or list(map(flag, defaults))
    return found


def check_given(options: dict[str, Any]) -> None:
    """Refuse the options a run would ignore, by what the user gave (see config.check_given).

    Raises:
        ConfigError: naming exactly the flags given in vain.
    """
    names = ("servers", *flatten(PSConfig(), PS_OPTIONS))  # the options' names: ps_mode, ...
    found = [flag(n) for n in names if options.get(n) is not None]
    strategy = options.get("strategy", "allreduce")
    if strategy != "ps" and found:
        verb = "applies" if len(found) == 1 else "apply"
        raise ConfigError(
            f"{', '.join(found)} {verb} to --strategy ps only, not --strategy {strategy}; "
            "add --strategy ps"
        )
    if strategy == "ps" and options.get("ps_mode", PSConfig.mode) == "sync":
        stale = [
            flag(n)
            for n in ("staleness", "stale_policy", "warm_start_steps")
            if options.get(n) is not None
        ]
        if stale:
            verb = "applies" if len(stale) == 1 else "apply"
            raise ConfigError(
                f"{', '.join(stale)} {verb} to --ps-mode async or ssp, not --ps-mode sync: in "
                "sync mode no gradient is stale and no worker runs ahead"
            )

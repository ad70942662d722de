"""One worker of `plait train`: `python -m plait.train.worker CONFIG_JSON`.

`plait train` starts one per rank through the local launcher (the machinery of
`plait run`), passing the validated TrainConfig as JSON. Rank 0 reports: as event lines for
the `plait train` process to render when PLAIT_TRAIN_EVENTS=1 (set by it), else with a bar
on a terminal or plain lines.

Errors the run explains itself (a non-finite loss: exit status 3; a checkpoint that cannot
be used: 2) are reported once, by rank 0, and rank 0 alone carries the status: every rank
sees them alike, and the other ranks exit 0. Under `plait train` rank 0 sends the error as
an event and exits 0 too, and the `plait train` process prints it and exits with the status
(so the launcher's "rank failed, its traceback" banner does not frame a message that is not
a crash).

The strategy's Step joins the job (`Step.join`): `plait.init()`, or with `--strategy ps`
`plait.ps.init()`, which decides the role from the rank: on a server rank it serves and
exits the process when the workers are done; on a worker it returns, and the worker trains
(no `plait.init()`: the workers must not depend on each other). Worker 0 reports, as rank 0
does otherwise.

With --elastic every rank has a renderer: rank 0 may die, and the new rank 0 reports from
then on (train/elastic.py); a rank fenced out of the job (frozen while the others went on)
says so and exits 1.

Test hook: PLAIT_TRAIN_STOP_AFTER=K ends the run after step K as if it were killed there
(see loop.train's stop_after).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from plait import allocator, env
from plait.comm import world
from plait.errors import EXIT_BAD_INPUT, FencedError
from plait.ps.errors import JobOverError
from plait.train import progress
from plait.train.config import TrainConfig
from plait.train.errors import CheckpointError, ConfigError, MissingExtraError, NonFiniteLossError
from plait.train.loop import train
from plait.train.step import step_type

EXIT_NON_FINITE = 3


def run(config: TrainConfig) -> int:
    """Train `config` as this process's rank of the job; return the exit status."""
    allocator.keep_freed()  # started by torchrun or `plait run`: not by job.py's environment
    kind = step_type(config.strategy, config.mesh.on_mesh, config.zero,
                     per_layer=config.layer_plan is not None)  # fmt: skip
    group = kind.join(config)  # a parameter-server rank serves and exits inside
    elastic = config.elastic.elastic
    renderer = None
    if group.rank == 0 or elastic:  # --elastic: whoever is rank 0 at the time reports
        renderer = progress.choose(sys.stdout, events=env.get("PLAIT_TRAIN_EVENTS"))
    emit = renderer.handle if renderer is not None else None

    def rank() -> int:  # the rank that explains errors: rank 0 of the job as it is now
        if elastic and config.strategy == "ps":
            return 0  # each worker explains its own (the others may train on without it)
        return world.default().rank if elastic else int(group.rank)

    try:
        train(config, group, emit=emit, t0=env.get("PLAIT_TRAIN_T0"),
              stop_after=env.get("PLAIT_TRAIN_STOP_AFTER"))  # fmt: skip
    except NonFiniteLossError as e:
        return _explain(rank(), renderer, e, EXIT_NON_FINITE)
    except (CheckpointError, ConfigError, MissingExtraError) as e:
        return _explain(rank(), renderer, e, EXIT_BAD_INPUT)
    except FencedError as e:  # --elastic: the others went on without this (frozen) rank
        print(f"plait train: {e}", file=sys.stderr, flush=True)
        return 1
    except JobOverError as e:  # --elastic --strategy ps: a joiner came after the last round
        print(f"plait train: {e}; nothing to train", file=sys.stderr, flush=True)
        return 0
    finally:
        if isinstance(renderer, progress.Bar):
            renderer.close()  # stop drawing, whatever happened
    return 0


def _explain(rank: int, renderer: progress.Renderer | None, error: Exception, code: int) -> int:
    if rank != 0:
        return 0
    if isinstance(renderer, progress.Events):
        renderer.handle("error", {"message": str(error), "code": code})
        return 0
    sys.stdout.flush()
    print(f"plait train: error: {error}", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m plait.train.worker CONFIG_JSON", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        config = TrainConfig.from_dict(json.loads(args[0]))
    except (ValueError, TypeError) as e:
        print(f"plait train worker: bad config: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run(config)


if __name__ == "__main__":
    sys.exit(main())

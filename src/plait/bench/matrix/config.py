"""`plait bench matrix`: its options. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.bench.fields import at_least_1, json_field, markdown_field
from plait.errors import ConfigError
from plait.options import option

WAYS = ("world", "commands")


@dataclass(kw_only=True)
class MatrixBenchConfig:
    """the option matrix: every cell of plait train's options trained or refused as expected.

    Each cell of train/matrix.py (a strategy on a mesh shape, with up to two of --zero,
    --schedule, --precision, --reduce-dtype/--compression, --priority,
    --activation-checkpointing, --compile and --out then --resume) is checked: a cell
    expected to be refused by the real checks `plait train` runs before any worker starts,
    with its one-line reason; a cell expected to train for 3 steps (a checkpoint cell
    stopped after step 2, then resumed), in one world or as a `plait train` job (--way),
    whose losses must stay within the cell's tolerance of its reference cell's (the same
    cell without one option); a cell with a known defect as the matrix names it. A line per
    cell as it ends; the exit status is 1 when any cell disagrees with the matrix.
    """

    only: str | None = field(
        default=None,
        metadata=option(
            "run the cells whose name holds TEXT (and their references), e.g. 'dp2 pp2'",
            metavar="TEXT",
        ),
    )
    way: str = field(
        default="world",
        metadata=option(
            "world: the cells that train run one after the other in one world of bench "
            "workers (the parameter server's as plait train jobs); commands: every cell a "
            "plait train job (slower: each starts its workers)",
            choices=WAYS,
        ),
    )
    skip_slow: bool = field(
        default=False, metadata=option("leave out the cells with --compile (slow to build)")
    )
    repeats: int = field(
        default=1, metadata=option("passes over the cells (a cell that disagrees once fails)")
    )
    json: str | None = json_field()
    markdown: bool = markdown_field()

    def __post_init__(self) -> None:
        at_least_1(repeats=self.repeats)
        if self.way not in WAYS:
            raise ConfigError(f"--way must be one of {', '.join(WAYS)}; got {self.way!r}")
        if self.only is not None and not self.only.strip():
            raise ConfigError("--only TEXT: TEXT is empty")

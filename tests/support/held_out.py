"""Fewer held-out windows for the language models that a world's ranks train.

`train()` ends every run with an evaluation, and a language model's reads up to 256 evenly
spaced held-out windows (LanguageModelling.max_val_windows): about two thirds of the CPU a
3-step gpt run costs here (~0.5 s of its ~0.8 s, measured on one rank). The worlds that
train gpt compare runs with one another (a mesh or ZeRO with one process, a resumed run with
an uninterrupted one) or check what is not the evaluation (losses, bytes, a trace's spans),
and 32 windows (2,048 predicted tokens) tell two models apart as well as 256.
"""

from __future__ import annotations

from plait.train.data.base import LanguageModelling

WINDOWS = 32


def few_held_out_windows(windows: int = WINDOWS) -> None:
    """From now on in this process (a world's rank, which ends with its world), a language
    model's evaluation reads at most `windows` evenly spaced held-out windows."""

    def num_val(self: LanguageModelling) -> int:
        return min(self._val_windows, windows)

    LanguageModelling.num_val = property(num_val)  # type: ignore[method-assign,assignment]

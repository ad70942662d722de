"""The errors `plait train` raises on purpose; each says what to do about it.

A bad option is plait's one `ConfigError` (plait/errors.py), the same class `plait run`
and `plait bench` raise, so one `except` catches every command's.
"""

from __future__ import annotations

from plait.errors import CheckpointError, ConfigError, MissingExtraError, PlaitError

__all__ = ["CheckpointError", "ConfigError", "MissingExtraError", "NonFiniteLossError"]


class NonFiniteLossError(PlaitError, FloatingPointError):
    """The training loss became NaN or infinite.

    Attributes:
        step: the first step (1-based) whose global-batch loss was not finite.
        loss: that loss.
        checkpoint_step: the step of the last good checkpoint kept on disk, or None.
    """

    def __init__(self, step: int, loss: float, checkpoint: str | None, checkpoint_step: int | None):
        self.step = step
        self.loss = loss
        self.checkpoint_step = checkpoint_step
        kept = (
            f"The last good checkpoint (step {checkpoint_step}) is kept at {checkpoint}."
            if checkpoint_step is not None
            else "No checkpoint was written before it."
        )
        super().__init__(
            f"the training loss is {loss} at step {step}; the run stopped. {kept} "
            "Try a lower --lr (or a longer --warmup-steps)."
        )

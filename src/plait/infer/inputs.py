"""What `plait infer --data` reads: the inputs to predict, with their labels when known.

- `val`, `train`: the run's own data, split as it trained on it (`Dataset.val_batch` /
  `train_batch`), labels included, so the held-out metric can be measured again; the
  data's own name (`digits` for a run trained with `--data digits`) is `val`;
- FILE.pt: `torch.load(weights_only=True)` of a tensor (inputs only: sample i is x[i]) or
  of a dict {"inputs": x, "targets": y} (targets optional);
- any other FILE, for a language model: its bytes, read as non-overlapping windows of the
  model's context (the targets are the next bytes, so the loss is known).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.errors import ConfigError
from plait.train.data import TASKS
from plait.train.data.base import LanguageModelling
from plait.train.workload import Workload


@dataclass
class Inputs:
    """`count` inputs, read by index: `batch(lo, hi)` gives inputs [lo, hi) and their
    targets (None when the data has no labels)."""

    name: str
    count: int
    read: Any  # (indices (n,) int64) -> (x, y | None)

    def batch(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, y = self.read(torch.arange(lo, hi))
        return x, y

    @property
    def labelled(self) -> bool:
        return self.batch(0, min(1, self.count))[1] is not None if self.count else False


def open_inputs(data: str, work: Workload, limit: int | None = None) -> Inputs:
    """The inputs `--data data` names for the run's workload `work` (first `limit` only).

    Raises:
        ConfigError: no such file, a file that holds no tensor of inputs, or a text file
            for a model that is not a language model.
    """
    found = _open(data, work)
    if limit is not None and limit < found.count:
        found = Inputs(found.name, limit, found.read)
    if found.count < 1:
        raise ConfigError(f"--data {data}: there are no inputs to predict")
    return found


def _open(data: str, work: Workload) -> Inputs:
    d = work.data
    path = Path(data)
    if data in ("val", d.name) and not (data == d.name and path.is_file()):
        return Inputs(f"{d.name} (held-out)", d.num_val, d.val_batch)
    if data == "train":
        return Inputs(f"{d.name} (train)", d.num_train, d.train_batch)
    if not path.is_file():
        other = f" (the run trained on {d.name}, not {data})" if data in TASKS else ""
        raise ConfigError(
            f"--data {data!r}: expected val or {d.name} (the held-out samples of the run's "
            f"data, {d.name}), train (its training samples) or a file; there is no such "
            f"file{other}"
        )
    if path.suffix == ".pt":
        return _tensors(path)
    if isinstance(d, LanguageModelling):
        tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        if d.vocab_size < 256:
            raise ConfigError(
                f"--data {data}: a file is read as bytes, and this model's vocabulary has "
                f"{d.vocab_size} < 256 tokens; give a .pt file of token ids"
            )
        windows = LanguageModelling(path.name, tokens, tokens, d.vocab_size, d.block_size,
                                    max_val_windows=len(tokens))  # fmt: skip
        if windows.num_val < 1:
            raise ConfigError(
                f"--data {data}: {len(tokens)} bytes, fewer than one window of "
                f"{d.block_size + 1} (the model's context and the next byte)"
            )
        return Inputs(path.name, windows.num_val, windows.val_batch)
    raise ConfigError(
        f"--data {data!r}: a model that is not a language model reads a .pt file (a tensor "
        "of inputs, or a dict with 'inputs' and optional 'targets'); got a "
        f"{path.suffix or 'suffix-less'} file"
    )


def _tensors(path: Path) -> Inputs:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"--data {path}: cannot read it as a torch file: {e}") from None
    if isinstance(loaded, torch.Tensor):
        x, y = loaded, None
    elif isinstance(loaded, dict) and isinstance(loaded.get("inputs"), torch.Tensor):
        x, y = loaded["inputs"], loaded.get("targets")
        if y is not None and (not isinstance(y, torch.Tensor) or len(y) != len(x)):
            raise ConfigError(
                f"--data {path}: 'targets' must be a tensor with one row per input "
                f"({len(x)}); got {type(y).__name__} of length {getattr(y, 'shape', ['?'])[0]}"
            )
    else:
        keys = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
        raise ConfigError(
            f"--data {path}: expected a tensor of inputs or a dict with 'inputs' (and "
            f"'targets'); got {keys}"
        )
    if x.dim() == 0:
        raise ConfigError(f"--data {path}: the inputs are a scalar; expected (samples, ...)")

    def read(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x[indices], None if y is None else y[indices]

    return Inputs(path.name, len(x), read)

"""Apply trained networks: `plait infer`, or from Python (docs/inference.md).

    from plait.infer import predict, load_run
    result = predict("runs/gpt", out="predictions.jsonl", workers=2, quantize="int8")
    trained = load_run("runs/gpt")          # the model with its trained weights, eval mode

The package imports torch on first use of these names, so the command line parses its
options without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.lazy import getattr_from

if TYPE_CHECKING:
    from plait.infer.job import InferError, InferResult, predict
    from plait.infer.quantize import model_bytes, prepare
    from plait.train.trained import Trained, load_run

_LAZY = {
    "predict": "plait.infer.job", "InferResult": "plait.infer.job", "InferError": "plait.infer.job",
    "load_run": "plait.train.trained", "Trained": "plait.train.trained",
    "prepare": "plait.infer.quantize", "model_bytes": "plait.infer.quantize",
}  # fmt: skip

__all__ = ["InferError", "InferResult", "Trained", "load_run", "model_bytes", "predict", "prepare"]

__getattr__ = getattr_from(__name__, _LAZY)

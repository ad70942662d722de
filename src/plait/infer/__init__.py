"""Apply trained networks: `plait infer`, or from Python (docs/inference.md).

    from plait.infer import predict, load_run
    result = predict("runs/gpt", out="predictions.jsonl", workers=2, quantize="int8")
    trained = load_run("runs/gpt")          # the model with its trained weights, eval mode

The package imports torch on first use of these names, so the command line parses its
options without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.infer.job import InferError, InferResult, predict
    from plait.infer.load import Trained, load_run
    from plait.infer.quantize import model_bytes, prepare

_WHERE = {
    "predict": "plait.infer.job", "InferResult": "plait.infer.job", "InferError": "plait.infer.job",
    "load_run": "plait.infer.load", "Trained": "plait.infer.load",
    "prepare": "plait.infer.quantize", "model_bytes": "plait.infer.quantize",
}  # fmt: skip

__all__ = ["InferError", "InferResult", "Trained", "load_run", "model_bytes", "predict", "prepare"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'plait.infer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)

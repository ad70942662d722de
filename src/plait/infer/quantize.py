"""Making one example fast: the model as it will predict (int8, bf16), and what it weighs.

- int8 (`--quantize int8`): dynamic quantization of every `nn.Linear`
  (`torch.ao.quantization.quantize_dynamic`): the weights are stored as int8 with one
  scale per tensor, and each forward quantizes its input activations per batch from their
  observed range, multiplies in int8 (fbgemm/x86 kernels), and returns fp32. Other layers
  (convolutions, embeddings, norms, attention) stay fp32. Jacob et al. 2018 give the
  affine scheme; torch's dynamic variant needs no calibration data.
- bf16 (`--precision bf16`): the weights cast to bfloat16 and floating inputs with them;
  outputs come back as fp32. It halves the bytes; its speed depends on the CPU's bf16
  support (AVX512-BF16 or AMX), which this project's 2-core AMD machine lacks (docs say so).
"""

from __future__ import annotations

import copy
import io
import warnings

import torch
from torch import nn

from plait.train.workload import stages

__all__ = ["Prepared", "model_bytes", "prepare"]


class Cast(nn.Module):
    """Floating inputs to `dtype`; other inputs (token ids) as they are."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x


class Prepared(nn.Module):
    """`module` called with its inputs in `dtype` (floating ones only), outputs in fp32.
    A pipeline cuts it as Cast(dtype), the module's stages, Cast(float32) (`layers`)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Cast(torch.float32)(self.module(Cast(self.dtype)(x)))

    def layers(self) -> list[nn.Module]:
        return [Cast(self.dtype), *stages(self.module), Cast(torch.float32)]


def prepare(model: nn.Module, quantize: str = "none", precision: str = "fp32") -> nn.Module:
    """A copy of `model` (eval mode) as `--quantize` and `--precision` say; `model` itself is
    left as it is.

    Raises:
        ValueError: an unknown quantize or precision value, or int8 with bf16.
    """
    if quantize not in ("none", "int8") or precision not in ("fp32", "bf16"):
        raise ValueError(
            f"quantize {quantize!r} / precision {precision!r}: expected none|int8 / fp32|bf16"
        )
    if quantize == "int8" and precision != "fp32":
        raise ValueError("int8 layers take fp32 activations: quantize int8 needs precision fp32")
    made = copy.deepcopy(model).eval()
    if quantize == "int8":
        with warnings.catch_warnings():  # torch.ao's deprecation notice: one per process
            warnings.simplefilter("ignore")
            made = torch.ao.quantization.quantize_dynamic(made, {nn.Linear}, dtype=torch.qint8)
    if precision == "bf16":
        made = Prepared(made.to(torch.bfloat16), torch.bfloat16)
    return made


def model_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s state_dict as torch.save writes it (int8 packed weights
    included): what the model weighs on disk and, roughly, in memory."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()

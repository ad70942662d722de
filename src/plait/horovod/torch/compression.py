"""Gradient compression with Horovod's contract: compress(t) -> (t', ctx), decompress(t', ctx)."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Base of compression schemes: static compress/decompress, as Horovod defines them."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and whatever decompress needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo compress on the reduced tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class CastCompressor(Compressor):
    """Sends floating-point tensors as `wire` (half the bytes of float32), other dtypes
    unchanged; decompress casts back to the tensor's own dtype."""

    wire: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.wire), tensor.dtype  # .to keeps autograd history
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx.is_floating_point:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(CastCompressor):
    """float16 on the wire: 10 mantissa bits, largest value 65504 (a sum may overflow)."""

    wire = torch.float16


class BF16Compressor(CastCompressor):
    """bfloat16 on the wire: float32's range (no overflow where float32 has none), 7
    mantissa bits (a relative rounding of 2^-8 per value). Not in Horovod: plait's."""

    wire = torch.bfloat16


class Compression:
    """The compressions: Horovod's `Compression.none` and `Compression.fp16`, and plait's
    `Compression.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

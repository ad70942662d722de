"""Tensor (intra-layer) parallelism: Megatron-LM's column/row/vocab-parallel layers."""

from plait.tensor_parallel.clip import clip_grad_norm_
from plait.tensor_parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from plait.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sharded_parameters,
)
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy
from plait.tensor_parallel.parallelize import parallelize, units

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "copy_to_tp",
    "gather_from_tp",
    "parallelize",
    "reduce_from_tp",
    "sharded_parameters",
    "split_to_tp",
    "units",
    "vocab_parallel_cross_entropy",
]

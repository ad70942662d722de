"""Activation checkpointing for any model: `plait.checkpoint_blocks(model)`.

A checkpointed block keeps only its input during forward; backward runs its forward again
to get the activations it needs (Chen et al., "Training deep nets with sublinear memory
cost", 2016). With L blocks that trades about one more forward pass for the activations of
L - 1 blocks. torch's non-reentrant checkpoint does the work (the reentrant one is
deprecated: it loses gradients of inputs that do not require grad, and cannot nest); the
RNG state is kept, so dropout masks repeat exactly.

Which blocks: by default the repeated ones, as FSDP2 wraps per block: the children of the
model's container (`nn.Sequential`, `nn.ModuleList`) that holds the most parameters in
modules of one class (a transformer's layers). `every=k` takes every k-th of them;
`policy(name, module)` chooses any modules instead.

A block is wrapped in place: its instance gets a `forward` that checkpoints the class's
own, so parameter names, `state_dict` keys and `deepcopy` are unchanged (a copy's blocks
checkpoint the copy). Under `torch.no_grad()` (evaluation) nothing is recomputed.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait import saved_tensors

Policy = Callable[[str, nn.Module], bool]
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def checkpoint_blocks(
    model: nn.Module, *, every: int = 1, policy: Policy | None = None
) -> list[str]:
    """Checkpoint blocks of `model` in place; returns the wrapped modules' names.

    Args:
        every: wrap every k-th repeated block (1: all of them), counting from the first.
        policy: `policy(name, module) -> bool` picks the modules to wrap instead of the
            repeated blocks (named as in `model.named_modules()`; `every` then does not apply).

    Raises:
        ValueError: `every` < 1; the model has no repeated blocks and no policy was given;
            or the policy picked nothing, or a module inside another picked one.
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1; got {every!r}")
    if policy is not None:
        picked = [(n, m) for n, m in model.named_modules() if n and policy(n, m)]
        if not picked:
            raise ValueError("the policy picked no module of the model to checkpoint")
        names = [n for n, _ in picked]
        nested = [n for n in names if any(n.startswith(f"{o}.") for o in names)]
        if nested:
            raise ValueError(
                f"the policy picked modules inside picked modules ({', '.join(nested[:3])}): "
                "checkpoint either the outer ones or the inner ones"
            )
    else:
        picked = repeated_blocks(model)[::every]
    for _, module in picked:
        _wrap(module)
    return [n for n, _ in picked]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children, with their names, of the container that holds the most parameters in
    two or more modules of one class (not containers themselves).

    Raises:
        ValueError: no container holds two modules of one class.
    """
    best: list[tuple[str, nn.Module]] = []
    best_params = -1
    for name, container in model.named_modules():
        if not isinstance(container, nn.Sequential | nn.ModuleList):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            if isinstance(child, _CONTAINERS):  # a block is a module of its own class
                continue
            full = f"{name}.{child_name}" if name else child_name
            by_class.setdefault(type(child), []).append((full, child))
        for blocks in by_class.values():
            params = sum(p.numel() for _, m in blocks for p in m.parameters())
            if len(blocks) >= 2 and params > best_params:
                best, best_params = blocks, params
    if not best:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (two or more modules of one class "
            "in an nn.Sequential or nn.ModuleList); pass policy=lambda name, module: ... "
            "to choose the modules to checkpoint"
        )
    return best


def blocks_worth_checkpointing(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`repeated_blocks(model)`, if checkpointing them saves memory: blocks of several layers.

    A single layer checkpointed keeps its input, which the layer keeps for backward anyway:
    no memory saved, one forward more paid. `plait train --activation-checkpointing` refuses
    such a model and `plait plan` does not propose it, by this one test.

    Raises:
        ValueError: no repeated blocks, or only single layers repeated (saying which).
    """
    blocks = repeated_blocks(model)
    if not any(any(True for _ in block.children()) for _, block in blocks):
        raise ValueError(
            f"the repeated modules of {type(model).__name__} are single layers "
            f"({type(blocks[0][1]).__name__}), whose checkpoint keeps the input the layer "
            "keeps anyway: no memory saved, a forward more paid. It is for models made of "
            "blocks (--model gpt, or your own)"
        )
    return blocks


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint_blocks` wrapped `module`."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward


def _wrap(module: nn.Module) -> None:
    if not is_checkpointed(module):  # twice is once
        module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    plain = type(self).forward.__get__(self)  # the class's forward, bound to this module
    if not torch.is_grad_enabled():
        return plain(*args, **kwargs)
    count = saved_tensors.current()  # a rank counting its activations: count recomputation
    fn = plain if count is None else saved_tensors.recounting(plain, count)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)

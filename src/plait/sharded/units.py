"""Choosing a model's units: the blocks whose parameters are gathered and reduced together.

By default the repeated blocks (a transformer's layers: `activations.repeated_blocks`), as
FSDP2 is applied per block; what no unit holds (embeddings, the head, final norms) forms
the root unit, gathered for the whole step. A model without repeated blocks is one root.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from plait.activations import repeated_blocks
from plait.sharded.layout import Layout

UnitChoice = None | Sequence[str] | Callable[[str, nn.Module], bool]

ROOT = ""  # the root unit's name


def choose(module: nn.Module, units: UnitChoice) -> list[tuple[str, nn.Module]]:
    """The unit modules, in registration order, none inside another.

    Raises:
        ValueError: a name that is no submodule, nested units, or a policy that picks the
            model itself.
    """
    if units is None:
        try:
            return repeated_blocks(module)
        except ValueError:
            return []
    if callable(units):
        picked = [(n, m) for n, m in module.named_modules() if n and units(n, m)]
    else:
        if isinstance(units, str):
            raise TypeError(f"units must be a list of module names; got the string {units!r}")
        names = set(units)
        known = dict(module.named_modules())
        unknown = sorted(n for n in names if n not in known or not n)
        if unknown:
            raise ValueError(
                f"units {unknown} are not submodules of {type(module).__name__}; "
                f"some that are: {[n for n in known if n][:8]}"
            )
        picked = [(n, m) for n, m in module.named_modules() if n in names]
    for outer, _ in picked:
        for inner, _ in picked:
            if inner != outer and inner.startswith(outer + "."):
                raise ValueError(f"unit {inner!r} is inside unit {outer!r}: units must not nest")
    return picked


def assign(
    module: nn.Module, chosen: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module | None, list[tuple[str, nn.Parameter]]]]:
    """Each unit's trainable parameters (a shared parameter goes to the first unit that
    holds it), then the root's: everything else. Units without parameters are dropped.

    Raises:
        ValueError: a unit mixes dtypes or devices (one flat tensor per unit).
    """
    taken: set[int] = set()
    out: list[tuple[str, nn.Module | None, list[tuple[str, nn.Parameter]]]] = []
    names = {id(p): n for n, p in module.named_parameters()}
    for name, unit in chosen:
        params = []
        for p in unit.parameters():
            if p.requires_grad and id(p) not in taken:
                taken.add(id(p))
                params.append((names[id(p)], p))
        if params:
            out.append((name, unit, params))
    rest = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in taken]
    if rest:
        out.append((ROOT, None, rest))
    for name, _, params in out:
        kinds = sorted({f"{p.dtype} on {p.device}" for _, p in params})
        if len(kinds) > 1:
            raise ValueError(
                f"unit {name or '(root)'!r} mixes {', '.join(kinds)}: a unit is one flat "
                "tensor; give the parameters one dtype and device, or choose other units"
            )
    return out


def layout_of(
    assigned: list[tuple[str, nn.Module | None, list[tuple[str, nn.Parameter]]]],
) -> Layout:
    return Layout.of(
        [
            (
                name,
                [(n, tuple(p.shape)) for n, p in params],
                str(params[0][1].dtype).removeprefix("torch."),
            )
            for name, _, params in assigned
        ]
    )

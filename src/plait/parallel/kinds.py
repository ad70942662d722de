"""What each layer of a model is to a per-layer plan (layout.py's LayerKind), from its module.

The layers are the model's pipeline layers (`layers_of`): an `nn.Sequential`'s children,
or what `model.layers()` returns (plait's gpt: Embed, its blocks, Head). A layer is

- LINEAR: an `nn.Linear` (column and row split its features);
- BLOCK: holds an attention or an MLP that `tensor_parallel.parallelize` splits (split);
- PARAMS: any other layer with parameters (Conv2d, an embedding, a layer norm ...);
- ELEMENTWISE: no parameters, and one of the elementwise activations in `ELEMENTWISE_TYPES`
  (it runs in any layout but a partial sum);
- PER_SAMPLE: no parameters otherwise (Flatten, MaxPool2d ...): it is taken to compute
  each sample (dim 0) on its own, as every layer of a model trained by batches does.
"""

from __future__ import annotations

from torch import nn

from plait.errors import ConfigError
from plait.parallel.layout import BLOCK, ELEMENTWISE, LINEAR, PARAMS, PER_SAMPLE, LayerKind
from plait.tensor_parallel.parallelize import units

ELEMENTWISE_TYPES = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.Identity)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """`model` as the list of layers whose composition is its forward.

    Raises:
        ConfigError: the model is neither an nn.Sequential nor has a layers() method.
    """
    as_layers = getattr(model, "layers", None)
    if callable(as_layers):
        found: list[nn.Module] = as_layers()
        return found
    if isinstance(model, nn.Sequential):
        return list(model)
    raise ConfigError(
        f"{type(model).__name__} is not a sequence of layers: build the model as an "
        "nn.Sequential, or give it a layers() method that returns its layers in order"
    )


def kind_of(layer: nn.Module) -> LayerKind:
    """`layer` as a per-layer plan sees it (module docstring)."""
    name = type(layer).__name__
    if isinstance(layer, nn.Linear):
        return LayerKind(f"Linear({layer.in_features}, {layer.out_features})", LINEAR,
                         layer.in_features, layer.out_features)  # fmt: skip
    if not any(True for _ in layer.parameters()):
        return LayerKind(name, ELEMENTWISE if isinstance(layer, ELEMENTWISE_TYPES) else PER_SAMPLE)
    found = units(layer)
    return LayerKind(name, BLOCK, units=found) if found else LayerKind(name, PARAMS)


def kinds(model: nn.Module) -> list[LayerKind]:
    """Every layer of `model` (`layers_of`), as a per-layer plan sees it."""
    return [kind_of(layer) for layer in layers_of(model)]

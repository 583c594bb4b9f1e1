"""Flat parameter vectors: the coordinates every Gaussian posterior lives in.

The order is ``model.parameters()`` order; for an ``nn.Linear`` layer that is its weight
(``(out, in)``, row-major) followed by its bias, so a per-example gradient ``δ aᵀ`` flattens
row-major into the right slice. :func:`param_layers` is the one walk over a model's layers that says which
entries each module's parameters hold (the layouts of ``bdl_bench.curvature`` and the layer-wise VI methods
read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from bdl_bench.errors import ConfigError


def flat_params(model: nn.Module) -> Tensor:
    """A detached copy of all parameters as one vector ``(D,)``."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class ParamLayer:
    """A module holding parameters of its own, and where they sit."""

    name: str  # qualified name in the model: "2", "lstm", "1.blocks.0.conv1"
    module: nn.Module
    positions: dict[str, int]  # own parameter ("weight", "bias", "weight_ih_l0", ...) -> place in model.parameters()
    slices: dict[str, slice]  # the same parameters' entries in the flat vector (each flattened row-major there)

    def offset(self, param: str) -> int | None:
        """Index of the first entry of the parameter ``param`` in the flat vector, ``None`` if the module has none
        (a layer without bias)."""
        part = self.slices.get(param)
        return None if part is None else part.start


def param_layers(model: nn.Module) -> list[ParamLayer]:
    """Every module of ``model`` that holds parameters of its own, in ``model.named_modules()`` order, which is
    the flat order (a parameter shared by two modules is listed under both, at its first place)."""
    positions: dict[int, int] = {}
    slices: dict[int, slice] = {}
    offset = 0
    for position, p in enumerate(model.parameters()):
        positions[id(p)] = position
        slices[id(p)] = slice(offset, offset + p.numel())
        offset += p.numel()
    layers = []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if own:
            where = {n: positions[id(p)] for n, p in own.items()}
            layers.append(ParamLayer(name, module, where, {n: slices[id(p)] for n, p in own.items()}))
    return layers


def sequential_layers(model: nn.Sequential) -> list[tuple[int, nn.Module, ParamLayer | None]]:
    """The children of ``model`` in order, each with its position and, if it holds parameters of its own, its
    :class:`ParamLayer` (a child used twice is listed twice)."""
    layer_of = {id(layer.module): layer for layer in param_layers(model)}
    return [(index, module, layer_of.get(id(module))) for index, module in enumerate(model)]


def _param_sizes(model: nn.Module, n_entries: int, what: str) -> tuple[list[tuple[str, nn.Parameter]], list[int]]:
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]
    if sum(sizes) != n_entries:
        raise ValueError(f"{what} {n_entries} entries, model has {sum(sizes)}")
    return named, sizes


def unflatten(model: nn.Module, theta: Tensor) -> dict[str, Tensor]:
    """Split ``theta`` (``(D,)``) into a ``{name: tensor}`` dict shaped like the model's parameters (views; one
    ``torch.split``, so that a backward through them assembles ``theta``'s gradient in one concatenation rather
    than one zero-filled ``(D,)`` tensor per parameter)."""
    named, sizes = _param_sizes(model, theta.numel(), "parameter vector has")
    return {name: part.view_as(p) for (name, p), part in zip(named, theta.split(sizes))}


def unflatten_stacked(model: nn.Module, thetas: Tensor) -> dict[str, Tensor]:
    """Split R stacked parameter vectors ``thetas`` ``(R, D)`` into ``{name: (R, *shape)}`` views (one split, as
    :func:`unflatten`)."""
    named, sizes = _param_sizes(model, thetas.shape[1], "parameter vectors have")
    return {name: part.reshape(thetas.shape[0], *p.shape) for (name, p), part in zip(named, thetas.split(sizes, dim=1))}


def forward_with(model: nn.Module, theta: Tensor, x: Tensor) -> Tensor:
    """``model(x)`` evaluated at the flat parameters ``theta`` (differentiable in ``theta``)."""
    return functional_call(model, unflatten(model, theta), (x,))


def prior_precision_vector(model: nn.Module, prior_precision: float, bias_prior_precision: float | None) -> Tensor:
    """Per-parameter precision ``(D,)`` of the zero-mean Gaussian prior; parameters whose name ends in ``bias`` get
    ``bias_prior_precision`` when it is given."""
    if not prior_precision > 0:
        raise ConfigError(f"prior_precision must be positive, got {prior_precision}")
    if bias_prior_precision is not None and not bias_prior_precision > 0:
        raise ConfigError(f"bias_prior_precision must be positive, got {bias_prior_precision}")
    parts = []
    for name, p in model.named_parameters():
        value = (
            bias_prior_precision if (bias_prior_precision is not None and name.endswith("bias")) else prior_precision
        )
        parts.append(torch.full((p.numel(),), float(value), dtype=p.dtype, device=p.device))
    return torch.cat(parts)

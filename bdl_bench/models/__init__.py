"""Plain ``nn.Module`` models, registered by the name used in ``conf/model/<name>.yaml``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

ModelBuilder = Callable[..., nn.Module]
MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def add(fn: ModelBuilder) -> ModelBuilder:
        if name in MODELS:
            raise ValueError(f"model name {name!r} is registered twice")
        MODELS[name] = fn
        return fn

    return add


def build_model(cfg: Mapping[str, Any], *, in_features: int, out_features: int) -> nn.Module:
    """Build the model named ``cfg['name']`` for the given input and output widths."""
    from bdl_bench.models import mlp  # noqa: F401  (registers)

    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    name = cfg["name"]
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name](in_features=in_features, out_features=out_features, **kwargs)

"""Plain ``nn.Module`` models, registered by the name used in ``conf/model/<name>.yaml``."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from bdl_bench.errors import ConfigError

ModelBuilder = Callable[..., nn.Module]
MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def add(fn: ModelBuilder) -> ModelBuilder:
        if name in MODELS:
            raise ValueError(f"model name {name!r} is registered twice")
        MODELS[name] = fn
        return fn

    return add


def import_all_models() -> None:
    """Import every submodule of :mod:`bdl_bench.models` once, so that all builders are registered."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def build_model(cfg: Mapping[str, Any], *, in_features: int, out_features: int) -> nn.Module:
    """Build the model named ``cfg['name']`` for the given input and output widths."""
    import_all_models()

    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    name = cfg["name"]
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name](in_features=in_features, out_features=out_features, **kwargs)

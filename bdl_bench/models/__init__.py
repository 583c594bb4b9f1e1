"""Plain ``nn.Module`` models, registered by the name used in ``conf/model/<name>.yaml``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from bdl_bench.registry import import_submodules, lookup, registrar

ModelBuilder = Callable[..., nn.Module]
MODELS: dict[str, ModelBuilder] = {}
register_model = registrar(MODELS, "model")


def build_model(cfg: Mapping[str, Any], *, in_features: int, out_features: int) -> nn.Module:
    """Build the model named ``cfg['name']`` for the given input and output widths."""
    import_submodules(__name__)
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return lookup(MODELS, cfg["name"], "model")(in_features=in_features, out_features=out_features, **kwargs)

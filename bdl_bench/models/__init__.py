"""Plain ``nn.Module`` models, registered by the name used in ``conf/model/<name>.yaml``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from bdl_bench.errors import ConfigError
from bdl_bench.registry import import_submodules, lookup, registrar

ModelBuilder = Callable[..., nn.Module]
MODELS: dict[str, ModelBuilder] = {}
register_model = registrar(MODELS, "model")


def build_model(cfg: Mapping[str, Any], *, in_features: int, out_features: int) -> nn.Module:
    """Build the model named ``cfg['name']`` for the given input and output widths."""
    import_submodules(__name__)
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return lookup(MODELS, cfg["name"], "model")(in_features=in_features, out_features=out_features, **kwargs)


def check_mode_free(model: nn.Module, method: str) -> None:
    """Refuse modules whose output depends on ``model.training``, which no method here switches: batch
    normalisation (in training mode a test image's prediction would depend on the other images of its batch, and
    prediction passes would move the running statistics) and dropout, except under ``method=dropout``, which draws
    its own masks at the model's ``nn.Dropout`` modules (any other method would draw torch's masks in every pass)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(
                f"model layer {name} is {type(module).__name__}: batch statistics would make each prediction depend"
                " on its batch, and no method here uses running statistics; build the model without it"
                " (model.batch_norm=false for resnet18)"
            )
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and method != "dropout":
            raise ConfigError(
                f"model layer {name} is {type(module).__name__}(p={module.p}), which only method=dropout samples;"
                f" with method={method} set model.dropout=0"
            )

"""``method.map_dir``: take the Laplace approximation's :math:`\\theta_{MAP}` from a finished run folder."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn

from bdl_bench.checkpoint import load_params
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians.io import load_gaussian
from bdl_bench.models import build_model
from bdl_bench.results import CHECKPOINT_FILE, PARAMS_FILE


def load_map_parameters(map_dir: str | Path, model: nn.Module) -> Tensor:
    """:math:`\\theta_{MAP}` from a finished run folder whose ``model`` config, rebuilt with ``model``'s input and
    output widths, gives the same modules: from, in order of preference, ``params.pt``
    (:func:`bdl_bench.checkpoint.save_params`), ``checkpoint.pt`` (a method state dict with ``theta``, optionally
    under ``"method"``) or ``posterior.pt`` (a saved Gaussian, centred at its MAP)."""
    folder = Path(map_dir)
    cfg_path = folder / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"laplace: map_dir {folder} is not a run folder (no config.yaml)")
    saved_cfg = yaml.safe_load(cfg_path.read_text()) or {}
    saved_model = saved_cfg.get("model")
    widths = {"in_features": _in_features(model), "out_features": _out_features(model)}
    try:
        rebuilt = repr(build_model(saved_model, **widths)) if isinstance(saved_model, dict) else None
    except (TypeError, ValueError):
        rebuilt = None
    if rebuilt != repr(model):
        raise ConfigError(
            f"laplace: the MAP in {folder} was trained with model config {saved_model} "
            f"(data {saved_cfg.get('data', {}).get('name')!r}), which does not match this run's model "
            f"{_describe(model)}; point method.map_dir at a run with the same model config"
        )
    checkpoint = folder / CHECKPOINT_FILE
    if (folder / PARAMS_FILE).is_file():
        theta = load_params(folder / PARAMS_FILE)["theta"]
    elif checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = state.get("method", state)
        if "theta" not in state:
            raise ConfigError(f"laplace: {checkpoint} has no 'theta' entry (keys: {sorted(state)})")
        theta = state["theta"]
    elif (folder / "posterior.pt").is_file():
        theta = load_gaussian(folder / "posterior.pt").mean
    else:
        raise ConfigError(
            f"laplace: {folder} holds none of {PARAMS_FILE}, {CHECKPOINT_FILE}, posterior.pt to take the MAP from"
        )
    n_params = sum(p.numel() for p in model.parameters())
    if theta.shape != (n_params,):
        raise ConfigError(
            f"laplace: the parameters in {folder} have shape {tuple(theta.shape)}, the model needs ({n_params},)"
        )
    return theta


def _in_features(model: nn.Module) -> int:
    """The ``in_features`` a model builder was given: flattened-row width for an ``nn.Unflatten`` head,
    else the first weight layer's inputs (or channels)."""
    first = next(iter(model.children()), None) if isinstance(model, nn.Sequential) else None
    if isinstance(first, nn.Unflatten):
        return math.prod(first.unflattened_size)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
        if isinstance(module, nn.Conv2d):
            return module.in_channels
    return 0


def _out_features(model: nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return last[-1].out_features if last and isinstance(last[-1], nn.Linear) else 0


def _describe(model: nn.Module) -> str:
    return " → ".join(repr(m) for m in model.children()) if isinstance(model, nn.Sequential) else repr(model)

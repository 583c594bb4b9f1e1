"""Shared builders for the layer-wise VI tests (gmfvi, ktied, elrg)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bdl_bench.likelihoods import Likelihood
from bdl_bench.methods import build_method
from bdl_bench.methods._diag_vi import local_reparam_linear
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector

COMMON = {"lr": 0.02, "n_train_mc_samples": 2, "init_std": 0.01, "kl_annealing_steps": 0, "snr_window": 0}
CONFIGS = {
    "gmfvi": {"name": "gmfvi", "conv_estimator": "local", **COMMON},
    "ktied": {"name": "ktied", "k": 2, "tie_conv": False, "conv_estimator": "local", **COMMON},
    "elrg": {"name": "elrg", "rank": 2, "learn_diag": False, **COMMON},
    "elrg_d": {"name": "elrg", "rank": 2, "learn_diag": True, **COMMON},
}


def make_method(kind: str, **overrides: object) -> Method:
    return build_method({**CONFIGS[kind], **overrides})


@torch.no_grad()
def weight_stds(method: Method) -> list[Tensor]:
    """Every weight's matrix of standard deviations of a set-up ``gmfvi`` or ``ktied``, layer by layer:
    ``(out, in)`` for ``nn.Linear``, ``(C_out, C_in·kh·kw)`` for ``nn.Conv2d``, ``(4H, in)`` and ``(4H, H)``
    for an ``nn.LSTM`` layer, ``(vocabulary, dim)`` for ``nn.Embedding``."""
    terms = method._step_terms(with_kl=False)
    return [method._param_std(terms, pos).flatten(1) for layer in method.layers for _, pos in layer.weight_matrices]


def init_(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """PyTorch's default Linear initialisation, drawn from ``generator`` (no global seeding)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            bound = 1 / math.sqrt(m.in_features)
            nn.init.uniform_(m.weight, -bound, bound, generator=generator)
            if m.bias is not None:
                nn.init.uniform_(m.bias, -bound, bound, generator=generator)
    return model


def make_problem(
    in_features: int,
    likelihood: Likelihood,
    seed: int,
    *,
    out_features: int = 1,
    n_data: int = 100,
    model_cfg: dict | None = None,
    dtype: torch.dtype = torch.float32,
    prior_precision: float = 1.0,
) -> Problem:
    g = torch.Generator().manual_seed(seed)
    cfg = model_cfg or {"name": "mlp", "hidden": [24, 24], "activation": "relu"}
    model = init_(build_model(cfg, in_features=in_features, out_features=out_features), g).to(dtype)
    prior = prior_precision_vector(model, prior_precision, None)
    return Problem(model=model, likelihood=likelihood, n_data=n_data, prior_precision=prior, generator=g)


def regression_data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y = sin(3x) + N(0, 0.1²) on [-1, 1]: 100 training and 100 test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(200, 1, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(200, generator=g)
    return x[:100], y[:100], x[100:], y[100:]


def plain_local_outputs(method: Method, mean: Tensor, var: Tensor, x: Tensor, n_samples: int) -> Tensor:
    """The slow twin of a dense network's locally reparameterised forward at flat ``mean`` and ``var``:
    ``_diag_vi.local_reparam_linear`` layer by layer, drawing from the problem's generator in the method's
    order; ``(S, N, out)``."""
    problem = method.problem
    means, variances = method.split_params(mean), method.split_params(var)
    h = x.unsqueeze(0).expand(n_samples, *x.shape)
    for module in problem.model.children():
        layer = method._layer_of.get(module)
        if layer is None:
            h = module(h)
            continue
        w, b = layer.weight_param, layer.bias_param
        h = local_reparam_linear(h, means[w], variances[w], means[b], variances[b], problem.generator)
    return h


def fit(method: Method, problem: Problem, x: Tensor, y: Tensor, n_epochs: int = 100, **kwargs: object) -> None:
    method.setup(problem)
    method.fit(x, y, n_epochs=n_epochs, batch_size=50, data_generator=torch.Generator().manual_seed(7), **kwargs)

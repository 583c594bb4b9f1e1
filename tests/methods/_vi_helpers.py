"""Shared builders for the layer-wise VI tests (gmfvi, ktied, elrg)."""

from __future__ import annotations

import _toy
import torch
from torch import Tensor

from bdl_bench.likelihoods import Likelihood
from bdl_bench.methods import build_method
from bdl_bench.methods._diag_vi import local_reparam_linear
from bdl_bench.methods.base import Method, Problem

VI_MLP = {"name": "mlp", "hidden": [24, 24], "activation": "relu"}
COMMON = {"lr": 0.02, "n_train_mc_samples": 2, "init_std": 0.01, "kl_annealing_steps": 0, "snr_window": 0}
CONFIGS = {
    "gmfvi": {"name": "gmfvi", "conv_estimator": "local", **COMMON},
    "ktied": {"name": "ktied", "k": 2, "tie_conv": False, "conv_estimator": "local", **COMMON},
    "elrg": {"name": "elrg", "rank": 2, "learn_diag": False, **COMMON},
    "elrg_d": {"name": "elrg", "rank": 2, "learn_diag": True, **COMMON},
}


def make_problem(in_features: int, likelihood: Likelihood, seed: int, **options: object) -> Problem:
    """:func:`_toy.make_problem` with a two-hidden-layer MLP unless ``model_cfg`` says otherwise."""
    options.setdefault("model_cfg", VI_MLP)
    return _toy.make_problem(in_features, likelihood, seed, **options)


def make_method(kind: str, **overrides: object) -> Method:
    return build_method({**CONFIGS[kind], **overrides})


@torch.no_grad()
def weight_stds(method: Method) -> list[Tensor]:
    """Every weight's matrix of standard deviations of a set-up ``gmfvi`` or ``ktied``, layer by layer:
    ``(out, in)`` for ``nn.Linear``, ``(C_out, C_in·kh·kw)`` for ``nn.Conv2d``, ``(4H, in)`` and ``(4H, H)``
    for an ``nn.LSTM`` layer, ``(vocabulary, dim)`` for ``nn.Embedding``."""
    terms = method._step_terms(with_kl=False)
    return [method._param_std(terms, pos).flatten(1) for layer in method.layers for _, pos in layer.weight_matrices]


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

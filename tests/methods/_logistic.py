"""The 2-D Bayesian logistic regression that exact VI and VOGN are checked on: N training and N test points."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bdl_bench.likelihoods import Bernoulli, Likelihood
from bdl_bench.methods.base import Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector

F64 = torch.float64
N = 60


def logistic_data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two correlated-scale features, labels from a logistic model: N training and N test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * N, 2, generator=g, dtype=F64) * torch.tensor([1.5, 0.7], dtype=F64)
    logits = x @ torch.tensor([1.2, -0.8], dtype=F64) + 0.3
    y = (torch.rand(2 * N, generator=g, dtype=F64) < torch.sigmoid(logits)).to(F64)
    return x[:N], y[:N], x[N:], y[N:]


def logistic_problem(
    *, bias: bool = True, seed: int = 1, model: nn.Module | None = None, likelihood: Likelihood | None = None
) -> Problem:
    """Logistic regression (or ``model``) at small random weights, prior precision 1, N examples."""
    g = torch.Generator().manual_seed(seed)
    if model is None:
        model = build_model({"name": "logreg", "bias": bias}, in_features=2, out_features=1).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=F64))
    prior = prior_precision_vector(model, 1.0, None)
    return Problem(model=model, likelihood=likelihood or Bernoulli(), n_data=N, prior_precision=prior, generator=g)

"""The tiny problems the method tests fit: a 1-d sine regression and a 2-d XOR classification (100 training and
100 test points each), an MLP initialised from a generator, and one fixed way of fitting."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from bdl_bench.likelihoods import Gaussian, Likelihood
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector

MLP = {"name": "mlp", "hidden": [32], "activation": "relu"}
NOISE_PRECISION = 100.0  # regression_data has noise std 0.1


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
    """An MLP (``model_cfg``, default :data:`MLP`) initialised from a generator seeded ``seed``, which the
    problem then carries; prior precision ``prior_precision`` on every parameter."""
    g = torch.Generator().manual_seed(seed)
    model = init_(build_model(model_cfg or MLP, in_features=in_features, out_features=out_features), g).to(dtype)
    prior = prior_precision_vector(model, prior_precision, None)
    return Problem(model=model, likelihood=likelihood, n_data=n_data, prior_precision=prior, generator=g)


def regression_data(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y = sin(3x) + N(0, 0.1²) on [-1, 1]: 100 training and 100 test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(200, 1, generator=g, dtype=dtype) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(200, generator=g, dtype=dtype)
    return x[:100], y[:100], x[100:], y[100:]


def classification_data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """XOR of the signs of two standard normal inputs: 100 training and 100 test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 2, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).float()
    return x[:100], y[:100], x[100:], y[100:]


def fit(method: Method, problem: Problem, x: Tensor, y: Tensor, n_epochs: int = 100, **kwargs: object) -> None:
    """Set ``method`` up on ``problem`` and fit it: batches of 50 in an order drawn from a generator seeded 7."""
    method.setup(problem)
    method.fit(x, y, n_epochs=n_epochs, batch_size=50, data_generator=torch.Generator().manual_seed(7), **kwargs)


def check_beats_training_mean(
    method: Method, n_samples: int = 32, problem: Callable[..., Problem] = make_problem
) -> Tensor:
    """Fit ``method`` on the sine regression (``problem(1, likelihood, seed=1)``) and assert that its predictive beats
    the training targets' mean and variance taken as a Gaussian: the predictive mean's test rmse under half of
    theirs and a lower test NLL. Returns the test outputs ``(n_samples, 100, 1)``."""
    x, y, x_test, y_test = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    fit(method, problem(1, likelihood, seed=1), x, y)
    f = method.predict(x_test, n_samples)
    assert f.shape == (n_samples, 100, 1)
    rmse = (f.mean(0).squeeze(-1) - y_test).pow(2).mean().sqrt()
    nll = -likelihood.log_predictive(f, y_test).mean()
    base_rmse = (y.mean() - y_test).pow(2).mean().sqrt()
    base_nll = (0.5 * torch.log(2 * math.pi * y.var()) + (y_test - y.mean()) ** 2 / (2 * y.var())).mean()
    assert rmse < 0.5 * base_rmse
    assert nll < base_nll
    return f

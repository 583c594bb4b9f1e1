"""HMC: moments of an exactly Gaussian posterior (Bayesian linear regression), repeatability, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Problem

F64 = torch.float64
CFG = {
    "name": "hmc",
    "n_samples": 600,
    "n_warmup": 200,
    "n_leapfrog": 6,
    "step_size": 0.01,
    "target_accept": 0.8,
    "thin": 1,
    "lr": 0.05,
}


def linear_regression(seed: int = 0):
    """y = x w + b + N(0, 1/4) with prior precisions (1, 2, 0.5): posterior N(mean, cov) in closed form."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(30, 2, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -2.0], dtype=F64) + 0.5 + torch.randn(30, generator=g, dtype=F64) / 2
    prior = torch.tensor([1.0, 2.0, 0.5], dtype=F64)
    design = torch.cat([x, torch.ones(30, 1, dtype=F64)], 1)
    precision = 4.0 * design.mT @ design + torch.diag(prior)
    cov = torch.linalg.inv(precision)
    mean = cov @ (4.0 * design.mT @ y)
    model = nn.Sequential(nn.Linear(2, 1)).to(F64)
    for param in model.parameters():
        nn.init.zeros_(param)  # no global RNG: the chain's start is fixed by the MAP fit from zero
    return Problem(model, Gaussian(4.0), 30, prior, torch.Generator().manual_seed(seed + 1)), x, y, mean, cov


def fit(seed: int = 0, **overrides):
    problem, x, y, mean, cov = linear_regression(seed)
    method = build_method({**CFG, **overrides})
    method.setup(problem)
    method.fit(x, y, n_epochs=3, batch_size=30, data_generator=torch.Generator().manual_seed(2))
    return method, x, mean, cov


@pytest.fixture(scope="module")
def fitted():
    return fit()


def test_chain_matches_the_gaussian_posterior(fitted) -> None:
    method, _, mean, cov = fitted
    samples = method.samples
    assert samples.shape == (600, 3)
    sd = cov.diagonal().sqrt()
    assert_close(samples.mean(0), mean, atol=float(0.25 * sd.min()), rtol=0)
    assert_close(samples.var(0), cov.diagonal(), rtol=0.3, atol=0)
    assert 0.6 < method.fit_info["accept_rate"] <= 1.0


def test_predict_uses_kept_states(fitted) -> None:
    method, x, _, _ = fitted
    f = method.predict(x, 10)
    assert f.shape == (10, 30, 1)
    assert float(f.std(0).mean()) > 0
    assert method.predict(x, 700).shape == (700, 30, 1)  # more than kept: cycled


def test_same_generator_same_chain() -> None:
    a, _, _, _ = fit(n_samples=20, n_warmup=10)
    b, _, _, _ = fit(n_samples=20, n_warmup=10)
    assert_close(a.samples, b.samples, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("key", "value"), [("n_samples", 0), ("n_leapfrog", 0), ("step_size", 0.0), ("target_accept", 1.0), ("thin", 0)]
)
def test_bad_values_are_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=key):
        build_method({**CFG, key: value})

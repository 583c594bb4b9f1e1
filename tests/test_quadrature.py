"""E[log σ(f)] for f ~ N(m, v): quadrature against Monte Carlo and scipy, the piecewise bound as a bound."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import integrate
from scipy.special import log_expit
from scipy.stats import norm
from torch.testing import assert_close

from bdl_bench.quadrature import (
    _PW_BREAKS,
    _PW_COEFFS,
    PIECEWISE_MAX_GAP,
    Expectation,
    expected_log_sigmoid,
    expected_log_sigmoid_with,
    piecewise_expected_log_sigmoid,
)

F64 = torch.float64
MEANS = [-20.0, -3.0, -0.5, 0.0, 1.0, 4.0, 15.0]
VARS = [0.0, 1e-4, 0.5, 1.9, 2.1, 10.0, 100.0, 1e4]


def grid() -> tuple[torch.Tensor, torch.Tensor]:
    m, v = torch.meshgrid(torch.tensor(MEANS, dtype=F64), torch.tensor(VARS, dtype=F64), indexing="ij")
    return m.reshape(-1), v.reshape(-1)


def scipy_reference(m: float, v: float) -> float:
    """Adaptive quadrature of log σ(f) N(f; m, v), split at the kink region and the mean."""
    if v == 0:
        return float(log_expit(m))
    s = math.sqrt(v)
    lo, hi = m - 40 * s - 60, m + 40 * s + 60
    edges = sorted({lo, hi, m, *[e for e in (-30.0, 0.0, 30.0) if lo < e < hi]})
    total = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        total += integrate.quad(
            lambda f: log_expit(f) * norm.pdf(f, m, s), a, b, limit=500, epsabs=1e-13, epsrel=1e-12
        )[0]
    return total


def test_matches_monte_carlo_on_a_grid_including_large_mean_and_variance(generator: torch.Generator) -> None:
    m, v = grid()
    n = 400_000
    eps = torch.randn(n, generator=generator, dtype=F64)
    samples = torch.nn.functional.logsigmoid(m[:, None] + v.sqrt()[:, None] * eps)  # (G, n)
    mc, se = samples.mean(1), samples.std(1) / math.sqrt(n)
    quad = expected_log_sigmoid(m, v)
    assert bool(((quad - mc).abs() <= 5 * se + 1e-12).all()), (quad - mc).abs() / (se + 1e-300)


def test_matches_scipy_adaptive_quadrature() -> None:
    m, v = grid()
    ref = torch.tensor([scipy_reference(a, b) for a, b in zip(m.tolist(), v.tolist())], dtype=F64)
    for n_points, tol in ((20, 2e-7), (32, 5e-9), (40, 5e-9)):
        assert_close(expected_log_sigmoid(m, v, n_points=n_points), ref, rtol=0, atol=tol)


def test_gradients_match_finite_differences_and_are_finite_at_zero_variance() -> None:
    m = torch.tensor([-6.0, -1.0, 0.0, 0.7, 3.0, 12.0], dtype=F64)
    for v0 in (0.3, 1.2, 5.0, 300.0):  # both quadrature regimes, away from the switch at v = 2
        v = torch.full_like(m, v0)
        mean, var = m.clone().requires_grad_(True), v.clone().requires_grad_(True)
        expected_log_sigmoid(mean, var).sum().backward()
        h = 1e-5
        fd_m = (expected_log_sigmoid(m + h, v) - expected_log_sigmoid(m - h, v)) / (2 * h)
        fd_v = (expected_log_sigmoid(m, v + h) - expected_log_sigmoid(m, v - h)) / (2 * h)
        assert_close(mean.grad, fd_m, rtol=1e-6, atol=1e-8)
        assert_close(var.grad, fd_v, rtol=1e-6, atol=1e-8)
    mean = m.clone().requires_grad_(True)
    var = torch.zeros_like(m, requires_grad=True)
    expected_log_sigmoid(mean, var).sum().backward()
    # At v = 0: d/dm = σ(-m) and d/dv = -σ(m)σ(-m)/2 (Bonnet's and Price's theorems).
    assert_close(mean.grad, torch.sigmoid(-m))
    assert_close(var.grad, -0.5 * torch.sigmoid(m) * torch.sigmoid(-m))


def test_broadcasts_and_keeps_float32() -> None:
    out = expected_log_sigmoid(torch.zeros(3, 1), torch.tensor([0.5, 3.0]))
    assert out.shape == (3, 2) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    ref = expected_log_sigmoid(torch.zeros(3, 1, dtype=F64), torch.tensor([0.5, 3.0], dtype=F64))
    assert_close(out, ref.float())
    pw = piecewise_expected_log_sigmoid(torch.tensor([0.0, 50.0]), torch.tensor([1e-30, 1e6]))
    assert pw.dtype == torch.float32 and bool(torch.isfinite(pw).all())


def test_softplus_upper_bound_is_a_tight_upper_bound() -> None:
    """The piecewise quadratic of the bound's table lies above log(1 + e^x), by at most the documented gap."""
    x = np.linspace(-60, 60, 1_200_001)
    a, b, c = np.asarray(_PW_COEFFS)[np.searchsorted(np.asarray(_PW_BREAKS), x, side="right")].T
    gap = (a * x + b) * x + c - np.logaddexp(0, x)
    assert gap.min() >= 0
    assert gap.max() <= PIECEWISE_MAX_GAP
    assert gap.max() >= 1e-4  # the documented gap, not a much looser one


def test_piecewise_bound_is_below_quadrature_and_close_to_it() -> None:
    m, v = grid()
    exact = expected_log_sigmoid(m, v)
    bound = piecewise_expected_log_sigmoid(m, v)
    assert bool((bound <= exact + 1e-10).all())
    assert bool((exact - bound <= PIECEWISE_MAX_GAP + 1e-10).all())


def test_piecewise_bound_is_differentiable() -> None:
    m = torch.tensor([-4.0, 0.0, 2.0], dtype=F64, requires_grad=True)
    v = torch.tensor([0.5, 3.0, 40.0], dtype=F64, requires_grad=True)
    piecewise_expected_log_sigmoid(m, v).sum().backward()
    q_m = m.detach().clone().requires_grad_(True)
    q_v = v.detach().clone().requires_grad_(True)
    expected_log_sigmoid(q_m, q_v).sum().backward()
    assert_close(m.grad, q_m.grad, rtol=0, atol=2e-3)
    assert_close(v.grad, q_v.grad, rtol=0, atol=2e-3)


def test_fit_softplus_bound_builds_a_valid_bound() -> None:
    path = Path(__file__).resolve().parents[1] / "scripts" / "fit_softplus_bound.py"
    spec = importlib.util.spec_from_file_location("fit_softplus_bound", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    breaks, coeffs = script.fit_softplus_bound(0.05)
    assert len(coeffs) == len(breaks) + 1 and breaks == sorted(breaks)
    x = np.linspace(-40, 40, 200_001)
    piece = np.searchsorted(np.asarray(breaks), x, side="right")
    a, b, c = np.asarray(coeffs)[piece].T
    gap = a * x**2 + b * x + c - np.logaddexp(0, x)
    assert gap.min() >= 0 and gap.max() <= 0.05 + 1e-7 + 1e-9


def test_bad_inputs_and_choices() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        expected_log_sigmoid(torch.zeros(2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="n_points"):
        expected_log_sigmoid(torch.zeros(2), torch.ones(2), n_points=1)
    with pytest.raises(ValueError, match="'laplace' is not a valid Expectation"):
        expected_log_sigmoid_with(torch.zeros(2), torch.ones(2), expectation="laplace", n_points=8)
    out = expected_log_sigmoid_with(torch.zeros(2), torch.ones(2), expectation=Expectation.PIECEWISE, n_points=8)
    assert_close(out, piecewise_expected_log_sigmoid(torch.zeros(2), torch.ones(2)))

"""Laplace ``method.search=marglik``: the log marginal likelihood, its gradients, the fit and a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _laplace import make_laplace
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.curvature.kron import kron_factors
from bdl_bench.curvature.pseudo_grads import block_index, iter_pseudo_grads
from bdl_bench.likelihoods import Categorical, Gaussian
from bdl_bench.methods.base import Problem
from bdl_bench.methods.laplace import Laplace, LaplaceEvidence
from bdl_bench.models import build_model
from bdl_bench.models.params import forward_with, prior_precision_vector
from bdl_bench.orchestration.runner import run

F64 = torch.float64
NOISE0 = 4.0  # the run's noise precision: the curvature is computed at it


def regression_problem(bias_prior: float | None = None) -> tuple[Problem, Tensor, Tensor]:
    """A 2-5-1 tanh MLP on 30 noisy points of a smooth function (float64), noise precision 4."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(30, 2, generator=g, dtype=F64) * 4 - 2
    y = torch.sin(x[:, 0]) + 0.3 * x[:, 1] + 0.5 * torch.randn(30, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [5], "activation": "tanh"}, in_features=2, out_features=1).to(F64)
    prior = prior_precision_vector(model, 2.0, bias_prior)
    return Problem(model, Gaussian(NOISE0), 30, prior, torch.Generator().manual_seed(1)), x, y


def fitted(structure: str, **options: object) -> tuple[Laplace, Problem, Tensor, Tensor]:
    """The MAP after 200 full-batch Adam steps, then the Laplace posterior with ``search=marglik`` (5 steps)."""
    problem, x, y = regression_problem()
    search = {"marglik": {"n_steps": 5, **options.pop("marglik", {})}}  # type: ignore[dict-item]
    method = make_laplace(structure=structure, curvature="ggn", search=search, lr=0.02, rank=2, **options)
    method.setup(problem)
    method.fit(x, y, n_epochs=200, batch_size=30, data_generator=torch.Generator().manual_seed(2))
    return method, problem, x, y


def finite_difference_gradient(objective: LaplaceEvidence, log_tau: Tensor, log_gamma: Tensor) -> Tensor:
    step, out = 1e-5, []
    point = torch.cat([log_tau, log_gamma[None]])
    for k in range(point.shape[0]):
        values = []
        for sign in (1, -1):
            moved = point.clone()
            moved[k] += sign * step
            values.append(float(objective(moved[:-1], moved[-1])))
        out.append((values[0] - values[1]) / (2 * step))
    return torch.tensor(out, dtype=F64)


def autograd_gradient(objective: LaplaceEvidence, log_tau: Tensor, log_gamma: Tensor) -> Tensor:
    log_tau, log_gamma = log_tau.clone().requires_grad_(True), log_gamma.clone().requires_grad_(True)
    grads = torch.autograd.grad(objective(log_tau, log_gamma), (log_tau, log_gamma))
    return torch.cat([grads[0], grads[1][None]])


CASES = [
    ("diag", {}),
    ("kfac", {}),
    ("kfac", {"kfac_prior": "exact"}),
    ("efb", {}),
    ("def", {}),
    ("block", {}),
    ("full", {}),
    ("full", {"marglik": {"prior": "scalar"}}),
]


@pytest.mark.parametrize("structure, options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_marglik_gradients_match_finite_differences(structure: str, options: dict) -> None:
    """d log p(D) / d(log τ_l, log γ) by autograd equals central differences of the same function, away from the
    optimum (KFAC's noise gradient included: its factors' eigenvalues scale with γ)."""
    method, *_ = fitted(structure, **dict(options))
    objective = method.last_evidence
    assert objective is not None
    n_groups = int(objective.groups.max()) + 1
    assert n_groups == (1 if options.get("marglik") else 2)
    log_tau = torch.linspace(-1.0, 1.5, n_groups, dtype=F64)
    log_gamma = torch.tensor(math.log(NOISE0) + 0.7, dtype=F64)
    grad = autograd_gradient(objective, log_tau, log_gamma)
    assert grad.abs().min() > 1e-3  # not at a stationary point
    assert_close(grad, finite_difference_gradient(objective, log_tau, log_gamma), rtol=1e-5, atol=1e-6)


def _jacobian(problem: Problem, theta: Tensor, x: Tensor) -> Tensor:
    return torch.func.jacrev(lambda th: forward_with(problem.model, th, x).squeeze(-1))(theta)


@pytest.mark.parametrize("structure", ["full", "kfac"])
def test_marglik_is_the_dense_laplace_evidence(structure: str) -> None:
    """The value against the textbook formula with an independently built precision: full: γ JᵀJ + diag(τ) (the
    GGN from the Jacobian); KFAC (exact prior): N(γ/γ₀) G ⊗ A + diag(τ) from recomputed factors. At two noise
    levels and two priors, so the dependence on γ (and its gradient) is checked, not only one point."""
    method, problem, x, y = fitted(structure, kfac_prior="exact")
    objective = method.last_evidence
    theta = method.theta.detach()
    f = forward_with(problem.model, theta, x).squeeze(-1)
    jac = _jacobian(problem, theta, x)
    factors = kron_factors(iter_pseudo_grads(problem.model, theta, x, y, problem.likelihood, batch_size=30))
    groups = objective.groups
    for log_tau, gamma in ((torch.tensor([0.3, -0.5], dtype=F64), 4.0), (torch.tensor([1.0, 2.0], dtype=F64), 0.7)):
        tau = log_tau.exp()[groups]
        if structure == "full":
            precision = gamma * jac.mT @ jac + torch.diag(tau)
        else:
            precision = torch.diag(tau)
            for factor in factors:
                idx = block_index(factor.slot)
                curvature = 30 * gamma / NOISE0 * torch.kron(factor.g_factor, factor.a_factor)
                precision[idx[:, None], idx[None, :]] += curvature
        log_lik = torch.distributions.Normal(f, gamma**-0.5).log_prob(y).sum()
        expected = log_lik - 0.5 * (tau * theta**2).sum() + 0.5 * tau.log().sum() - 0.5 * torch.logdet(precision)
        assert_close(objective(log_tau, torch.tensor(math.log(gamma), dtype=F64)), expected)


def test_marglik_fit_raises_the_evidence_and_sets_prior_and_noise() -> None:
    method, problem, *_ = fitted("kfac", kfac_prior="exact", marglik={"n_steps": 200, "noise": True})
    metrics = method.extra_metrics
    assert metrics["marglik"] > metrics["marglik_initial"]
    objective = method.last_evidence
    log_tau = torch.tensor([metrics["chosen_prior_precision_0"], metrics["chosen_prior_precision_1"]]).log().to(F64)
    log_gamma = torch.tensor(math.log(metrics["chosen_noise_precision"]), dtype=F64)
    grad = autograd_gradient(objective, log_tau, log_gamma)
    assert grad.abs().max() < 0.05 * 30  # near a stationary point (per example: < 0.05)
    assert method.fitted_likelihood == Gaussian(metrics["chosen_noise_precision"])
    expected = objective.posterior(log_tau, log_gamma)
    assert_close(method.posterior().to_dense().precision, expected.to_dense().precision)


def test_marglik_for_classification_fits_the_prior_only() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=g, dtype=F64), torch.randint(0, 3, (40,), generator=g)
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [4], "activation": "relu"}, in_features=3, out_features=3).to(F64)
    problem = Problem(model, Categorical(), 40, prior_precision_vector(model, 1.0, None), torch.Generator())
    method = make_laplace(structure="diag", search="marglik")
    method.setup(problem)
    method.fit(x, y, n_epochs=20, batch_size=40, data_generator=torch.Generator().manual_seed(2))
    assert method.fitted_likelihood is None and "chosen_noise_precision" not in method.extra_metrics
    assert method.extra_metrics["marglik"] > method.extra_metrics["marglik_initial"]


@pytest.mark.parametrize(
    "search, match",
    [
        ("evidence", "marglik"),
        ({"marglik": {"prior": "unit"}}, "layer or scalar"),
        ({"marglik": {"n_steps": 0}}, "n_steps"),
        ({"marglik": {"steps": 3}}, "unknown"),
        ({"marglik": {"noise": "residuals"}}, "true, false or residual"),
    ],
)
def test_bad_marglik_settings_are_refused(search: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_laplace(search=search)


def test_a_regression_run_is_scored_with_the_fitted_noise(tmp_path: Path, compose_cfg) -> None:
    """``method.search=marglik`` needs no validation data; the final metrics use the noise it chose."""
    cfg = compose_cfg(
        ["method=laplace", "data=toy/cubic", "method.structure=full", "method.search=marglik", "trainer.n_epochs=50"]
    )
    run(cfg, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["marglik"] > metrics["marglik_initial"]
    gamma = metrics["chosen_noise_precision"]
    assert gamma > 0 and math.isfinite(metrics["nll"])
    assert abs(math.log(gamma / (0.1111 * 1.0))) > 1e-3  # moved from the config's noise (standardised units differ)


def test_residual_noise_is_the_maps_mean_squared_residual_and_only_the_prior_moves() -> None:
    """``noise: residual`` fixes γ = n / Σ (f_* − y)² (laplace-torch's sigma_noise from the residuals) and fits τ at it."""
    method, problem, x, y = fitted("diag", marglik={"noise": "residual", "n_steps": 200})
    metrics = method.extra_metrics
    with torch.no_grad():
        residual = forward_with(problem.model, method.theta.detach(), x).squeeze(-1) - y
    gamma = 1.0 / residual.square().mean().item()
    assert metrics["chosen_noise_precision"] == pytest.approx(gamma, rel=1e-10)
    assert method.fitted_likelihood == Gaussian(metrics["chosen_noise_precision"])
    objective = method.last_evidence
    log_tau = torch.tensor([metrics["chosen_prior_precision_0"], metrics["chosen_prior_precision_1"]]).log().to(F64)
    log_gamma = torch.tensor(math.log(gamma), dtype=F64)
    grad = autograd_gradient(objective, log_tau, log_gamma)
    assert grad[:-1].abs().max() < 0.05 * 30  # τ at its optimum for this γ ...
    assert grad[-1].abs() > 0.05 * 30  # ... and γ is not the joint optimum (it was held fixed)
    expected = objective.posterior(log_tau, log_gamma)
    assert_close(method.posterior().to_dense().precision, expected.to_dense().precision)

"""Exact Gaussian VI for logistic regression: stationarity, ELBO ordering, bound, refusals."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import yaml
from _logistic import N, logistic_data, logistic_problem
from torch import Tensor, nn
from torch.testing import assert_close

from bdl_bench.gaussians import DiagGaussian, FullGaussian, StructuredGaussian, sym_kl
from bdl_bench.likelihoods import Bernoulli, Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Method, Problem
from bdl_bench.methods.exact_vi import ExactVI, logistic_design, logistic_elbo_from_scale
from bdl_bench.models import build_model
from bdl_bench.quadrature import PIECEWISE_MAX_GAP, expected_log_sigmoid_with

F64 = torch.float64
CONF = Path(__file__).resolve().parents[2] / "conf" / "method" / "exact_vi.yaml"


def logistic_elbo(
    q: StructuredGaussian, x: Tensor, y: Tensor, prior_precision: Tensor, *, expectation: str = "quadrature"
) -> Tensor:
    """The ELBO per example of logistic regression for any Gaussian ``q``, from its own moments and KL: the
    twin of ``logistic_elbo_from_scale``."""
    moments = q.linear_moments(x)
    signed = (2.0 * y.to(moments.mean) - 1.0) * moments.mean
    ell = expected_log_sigmoid_with(signed, moments.variance, expectation=expectation, n_points=32)
    prior = DiagGaussian(torch.zeros_like(q.mean), prior_precision.to(q.mean))
    return (ell.sum() - q.kl(prior)) / x.shape[0]


def make_exact(**overrides: object) -> Method:
    cfg = {
        "name": "exact_vi",
        "covariance": "full",
        "expectation": "quadrature",
        "n_quadrature": 32,
        "max_iter": 500,
        "tolerance": 1e-9,
    }
    return build_method({**cfg, **overrides})


def fit_exact(problem: Problem, **overrides: object) -> tuple[ExactVI, list[tuple[int, Mapping[str, float]]]]:
    x, y, _, _ = logistic_data()
    method = make_exact(**overrides)
    assert isinstance(method, ExactVI)
    method.setup(problem)
    logs: list[tuple[int, Mapping[str, float]]] = []
    method.fit(
        x,
        y,
        n_epochs=3,
        batch_size=8,
        data_generator=torch.Generator().manual_seed(0),
        on_epoch_end=lambda e, m: logs.append((e, dict(m))),
    )
    return method, logs


def laplace(problem: Problem, x: Tensor, y: Tensor) -> FullGaussian:
    """MAP by Newton's method, precision = exact Hessian of the negative log joint there."""
    lam = problem.prior_precision
    theta = torch.zeros_like(lam)
    for _ in range(50):
        f = x @ theta
        grad = x.T @ (torch.sigmoid(f) - y) + lam * theta
        hess = x.T @ (torch.sigmoid(f) * torch.sigmoid(-f))[:, None].mul(x) + torch.diag(lam)
        theta = theta - torch.linalg.solve(hess, grad)
    f = x @ theta
    hess = x.T @ (torch.sigmoid(f) * torch.sigmoid(-f))[:, None].mul(x) + torch.diag(lam)
    return FullGaussian(theta, hess)


def test_full_solution_is_a_stationary_point_of_the_elbo() -> None:
    problem = logistic_problem()
    method, logs = fit_exact(problem)
    x, y, _, _ = logistic_data()
    design = logistic_design(problem.model, x)
    assert design.shape == (N, 3) and bool((design[:, -1] == 1).all())
    mean = method.state.mean.clone().requires_grad_(True)
    scale = method.state.scale.clone().requires_grad_(True)
    elbo = logistic_elbo_from_scale(mean, scale, design, y, problem.prior_precision)
    elbo.backward()
    assert mean.grad.abs().max() < 1e-6
    assert torch.tril(scale.grad).abs().max() < 1e-6
    # The fit moved far from its start: the gradient at the initial point is large.
    start = logistic_problem()
    init_scale = torch.diag(start.prior_precision.rsqrt()).requires_grad_(True)
    init_mean = torch.zeros(3, dtype=F64, requires_grad=True)
    logistic_elbo_from_scale(init_mean, init_scale, design, y, start.prior_precision).backward()
    assert init_mean.grad.abs().max() > 1e-2
    # One report, at the last epoch, with the ELBO per example of the returned posterior.
    assert [e for e, _ in logs] == [3]
    metrics = logs[0][1]
    assert_close(metrics["train/elbo"], elbo.item(), rtol=0, atol=1e-12)
    assert_close(metrics["train/loss"], -metrics["train/elbo"])
    assert metrics["train/grad_max"] < 1e-6 and metrics["train/n_iter"] >= 1
    kl = float(method.kl_to_prior())
    assert_close(metrics["train/nll"], -metrics["train/elbo"] - kl / N, rtol=0, atol=1e-10)


def test_elbo_of_the_gaussian_object_matches_the_optimised_objective() -> None:
    problem = logistic_problem()
    method, _ = fit_exact(problem)
    x, y, _, _ = logistic_data()
    design = logistic_design(problem.model, x)
    q = method.posterior()
    assert isinstance(q, FullGaussian)
    assert_close(q.covariance, method.state.scale @ method.state.scale.T)
    from_q = logistic_elbo(q, design, y, problem.prior_precision)
    from_scale = logistic_elbo_from_scale(method.state.mean, method.state.scale, design, y, problem.prior_precision)
    assert_close(from_q, from_scale, rtol=0, atol=1e-12)


def test_full_elbo_beats_mean_field_and_laplace() -> None:
    problem = logistic_problem()
    x, y, _, _ = logistic_data()
    design = logistic_design(problem.model, x)
    full, _ = fit_exact(problem)
    diag, _ = fit_exact(logistic_problem(), covariance="diag")
    lam = problem.prior_precision
    elbo_full = float(logistic_elbo(full.posterior(), design, y, lam))
    elbo_diag = float(logistic_elbo(diag.posterior(), design, y, lam))
    elbo_laplace = float(logistic_elbo(laplace(problem, design, y), design, y, lam))
    assert elbo_full > elbo_diag + 1e-5
    assert elbo_full > elbo_laplace + 1e-6
    # The mean-field optimum is stationary in its own family.
    mean = diag.state.mean.clone().requires_grad_(True)
    std = diag.state.scale.clone().requires_grad_(True)
    assert std.shape == (3,)
    logistic_elbo_from_scale(mean, std, design, y, lam).backward()
    assert max(mean.grad.abs().max(), std.grad.abs().max()) < 1e-6


def test_piecewise_bound_gives_a_lower_elbo_and_nearly_the_same_posterior() -> None:
    problem = logistic_problem()
    x, y, _, _ = logistic_data()
    design = logistic_design(problem.model, x)
    quad, _ = fit_exact(problem)
    piecewise, logs = fit_exact(logistic_problem(), expectation="piecewise")
    q = piecewise.posterior()
    lam = problem.prior_precision
    exact_at_q = float(logistic_elbo(q, design, y, lam))
    bound_at_q = float(logistic_elbo(q, design, y, lam, expectation="piecewise"))
    assert bound_at_q <= exact_at_q <= bound_at_q + PIECEWISE_MAX_GAP
    assert_close(logs[0][1]["train/elbo"], bound_at_q, rtol=0, atol=1e-10)
    assert float(sym_kl(q, quad.posterior())) < 1e-4


def test_model_without_bias() -> None:
    problem = logistic_problem(bias=False)
    method, _ = fit_exact(problem)
    x, y, _, _ = logistic_data()
    design = logistic_design(problem.model, x)
    assert design.shape == (N, 2)
    mean = method.state.mean.clone().requires_grad_(True)
    scale = method.state.scale.clone().requires_grad_(True)
    logistic_elbo_from_scale(mean, scale, design, y, problem.prior_precision).backward()
    assert mean.grad.abs().max() < 1e-6


def test_predict_beats_the_base_rate_and_uses_the_problem_generator() -> None:
    problem = logistic_problem()
    method, _ = fit_exact(problem)
    x, y, x_test, y_test = logistic_data()
    state = problem.generator.get_state()
    f = method.predict(x_test, 64)
    assert f.shape == (64, N, 1)
    problem.generator.set_state(state)
    assert_close(method.predict(x_test, 64), f)
    nll = -Bernoulli().log_predictive(f, y_test).mean()
    rate = y.mean()
    base = -(y_test * rate.log() + (1 - y_test) * (1 - rate).log()).mean()
    assert nll < base - 0.05


def test_state_dict_round_trip_and_finished_fit_is_skipped() -> None:
    problem = logistic_problem()
    method, _ = fit_exact(problem)
    fresh = make_exact()
    fresh.setup(logistic_problem())
    fresh.load_state_dict(method.state_dict())
    assert_close(fresh.posterior().precision, method.posterior().precision)
    assert_close(fresh.kl_to_prior(), method.kl_to_prior())
    logs: list[int] = []
    x, y, _, _ = logistic_data()
    fresh.fit(
        x,
        y,
        n_epochs=3,
        batch_size=8,
        data_generator=torch.Generator(),
        on_epoch_end=lambda e, m: logs.append(e),
        start_epoch=3,
    )
    assert logs == [] and fresh.state.n_iter == method.state.n_iter
    with pytest.raises(ValueError, match="checkpoint shapes"):
        diag = make_exact(covariance="diag")
        diag.setup(logistic_problem())
        diag.load_state_dict(method.state_dict())


def test_refuses_models_and_likelihoods_that_are_not_logistic_regression() -> None:
    method = make_exact()
    mlp = build_model({"name": "mlp", "hidden": [4], "activation": "tanh"}, in_features=2, out_features=1).to(F64)
    with pytest.raises(ValueError, match="single nn.Linear"):
        method.setup(logistic_problem(model=mlp))
    two_out = nn.Sequential(nn.Linear(2, 2)).to(F64)
    with pytest.raises(ValueError, match="one output"):
        method.setup(logistic_problem(model=two_out))
    with pytest.raises(ValueError, match="Bernoulli"):
        method.setup(logistic_problem(likelihood=Gaussian(1.0)))
    with pytest.raises(NotImplementedError, match="L-BFGS"):
        method.setup(logistic_problem())
        method.train_step(*logistic_data()[:2])


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("covariance", "lowrank", "choices: full, diag"),
        ("expectation", "mc", "choices: quadrature, piecewise"),
        ("n_quadrature", 1, "n_quadrature"),
        ("max_iter", 0, "max_iter"),
        ("tolerance", 0.0, "tolerance"),
    ],
)
def test_bad_options_are_refused(key: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_exact(**{key: value})


def test_yaml_keys_are_the_constructor_parameters() -> None:
    cfg = yaml.safe_load(CONF.read_text())
    assert cfg["name"] == "exact_vi"
    method = build_method(cfg)
    assert isinstance(method, ExactVI) and method.covariance.value == "full"

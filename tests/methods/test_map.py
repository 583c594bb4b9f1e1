"""MAP with Adam: fits tiny problems, point predictions, checkpoint round trip."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from _toy import NOISE_PRECISION, check_beats_training_mean, classification_data, fit, make_problem, regression_data
from torch import Tensor
from torch.testing import assert_close

import bdl_bench.progress as progress_module
from bdl_bench.likelihoods import Bernoulli, Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods._shared import add_prior_term
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models.params import flat_params, forward_with, prior_precision_vector


def make_map(**overrides: object) -> Method:
    return build_method({"name": "map", "lr": 0.02, **overrides})


def test_beats_training_mean_on_regression() -> None:
    f = check_beats_training_mean(make_map(), n_samples=3)
    assert_close(f[1], f[0], rtol=0, atol=0)  # a point estimate: every sample is the same network


def test_beats_chance_on_two_classes() -> None:
    x, y, x_test, y_test = classification_data(0)
    method = make_map()
    fit(method, make_problem(2, Bernoulli(), seed=1), x, y)
    nll = -Bernoulli().log_predictive(method.predict(x_test, 1), y_test).mean()
    assert nll < 0.8 * math.log(2)


def test_predict_leaves_the_model_and_global_rng_alone() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    before = [p.detach().clone() for p in problem.model.parameters()]
    x, y, _, _ = regression_data(0)
    method = make_map()
    global_state = torch.get_rng_state()
    fit(method, problem, x, y, n_epochs=2)
    method.predict(x, 2)
    assert torch.equal(torch.get_rng_state(), global_state)
    for p, p0 in zip(problem.model.parameters(), before):
        assert_close(p, p0, rtol=0, atol=0)


@pytest.mark.parametrize("lr", [0.0, -0.01])
def test_bad_lr_raises(lr: float) -> None:
    with pytest.raises(ValueError, match=rf"map: method\.lr={lr} is out of range: it must be a number > 0"):
        make_map(lr=lr)


def test_checkpoint_round_trip_gives_identical_next_step() -> None:
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    a, b = make_map(), make_map()
    fit(a, make_problem(1, likelihood, seed=1), x, y, n_epochs=2)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.setup(make_problem(1, likelihood, seed=2))
    b.load_state_dict(torch.load(buffer, weights_only=True))
    for method in (a, b):
        method.train_step(x[:25], y[:25])
    assert_close(b.state_dict()["theta"], a.state_dict()["theta"], rtol=0, atol=0)


@pytest.mark.parametrize("enabled", [True, False])
def test_long_epochs_show_a_step_bar_when_progress_is_on(enabled: bool, capsys, monkeypatch) -> None:
    monkeypatch.setattr(progress_module, "BAR_DELAY_S", 0.0)  # every epoch counts as long here
    method = make_map()
    method.setup(make_problem(2, Gaussian(NOISE_PRECISION), seed=0))
    method.step_progress = enabled
    x, y = torch.randn(40, 2), torch.randn(40)
    method.fit(x, y, n_epochs=2, batch_size=10, data_generator=torch.Generator().manual_seed(0))
    err = capsys.readouterr().err
    assert ("epoch 1:" in err and "epoch 2:" in err and "/4 [" in err and "step/s" in err) == enabled
    assert enabled or err == ""


def autograd_map_step(
    problem: Problem, theta: Tensor, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor
) -> Tensor:
    """The slow twin of ``map_step``: the whole objective through autograd, then the optimiser's step."""
    optimizer.zero_grad(set_to_none=True)
    nll = problem.likelihood.nll(forward_with(problem.model, theta, x), y).mean()
    loss = nll + 0.5 * (problem.prior_precision * theta**2).sum() / problem.n_data
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_step_equals_autograd_of_the_objective_with_plain_adam() -> None:
    """The prior's gradient added in place and the fused Adam give the steps of autograd + the plain Adam (float64,
    several steps, a per-parameter prior with its own bias precision)."""
    x, y, _, _ = regression_data(0)
    base = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=1)
    base.model.double()
    problem = dataclasses.replace(base, prior_precision=prior_precision_vector(base.model, 3.0, 0.5).double())
    method = make_map()
    method.setup(problem)
    assert method.optimizer.param_groups[0]["fused"]
    twin = flat_params(problem.model).requires_grad_(True)
    plain = torch.optim.Adam([twin], lr=0.02)
    for i in range(5):
        batch = slice(10 * i, 10 * i + 25)
        out = method.train_step(x[batch].double(), y[batch].double())
        loss = autograd_map_step(problem, twin, plain, x[batch].double(), y[batch].double())
        assert_close(out["loss"], loss, rtol=1e-12, atol=0)
    assert_close(method.theta.detach(), twin.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.equal(twin.detach(), flat_params(problem.model))


@pytest.mark.parametrize("prior_rows", [None, 1, 3])  # (D,), one (1, D) row for all, a row per row of theta
def test_add_prior_term_rows_match_autograd(prior_rows: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    shape = (7,) if prior_rows is None else (prior_rows, 7)
    prior = torch.rand(shape, generator=g, dtype=torch.float64) + 0.1
    term = 0.5 * (prior * theta**2).sum(1) / 40
    (grad,) = torch.autograd.grad(term.sum(), theta)
    theta.grad = torch.full_like(theta, 2.0)
    assert_close(add_prior_term(theta, prior, 40), term.detach(), rtol=1e-14, atol=0)
    assert_close(theta.grad, grad + 2.0, rtol=1e-14, atol=0)

"""MAP with Adam: fits tiny problems, point predictions, checkpoint round trip."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import bdl_bench.progress as progress_module
from bdl_bench.likelihoods import Bernoulli, Gaussian, Likelihood
from bdl_bench.methods import build_method
from bdl_bench.methods._shared import add_prior_term
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, forward_with, prior_precision_vector

NOISE_PRECISION = 100.0  # the regression data below has noise std 0.1


def make_map(**overrides: object) -> Method:
    return build_method({"name": "map", "lr": 0.02, **overrides})


def init_(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """PyTorch's default Linear initialisation, drawn from ``generator`` (no global seeding)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            bound = 1 / math.sqrt(m.in_features)
            nn.init.uniform_(m.weight, -bound, bound, generator=generator)
            nn.init.uniform_(m.bias, -bound, bound, generator=generator)
    return model


def make_problem(in_features: int, likelihood: Likelihood, seed: int) -> Problem:
    g = torch.Generator().manual_seed(seed)
    cfg = {"name": "mlp", "hidden": [32], "activation": "relu"}
    model = init_(build_model(cfg, in_features=in_features, out_features=1), g)
    prior = prior_precision_vector(model, 1.0, None)
    return Problem(model=model, likelihood=likelihood, n_data=100, prior_precision=prior, generator=g)


def regression_data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y = sin(3x) + N(0, 0.1²) on [-1, 1]: 100 training and 100 test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(200, 1, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(200, generator=g)
    return x[:100], y[:100], x[100:], y[100:]


def classification_data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """XOR of the signs of two standard normal inputs: 100 training and 100 test points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 2, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).float()
    return x[:100], y[:100], x[100:], y[100:]


def fit(method: Method, problem: Problem, x: Tensor, y: Tensor, n_epochs: int = 100) -> None:
    method.setup(problem)
    method.fit(x, y, n_epochs=n_epochs, batch_size=50, data_generator=torch.Generator().manual_seed(7))


def test_beats_training_mean_on_regression() -> None:
    x, y, x_test, y_test = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    method = make_map()
    fit(method, make_problem(1, likelihood, seed=1), x, y)
    f = method.predict(x_test, 3)
    assert f.shape == (3, 100, 1)
    assert_close(f[1], f[0], rtol=0, atol=0)  # a point estimate: every sample is the same network
    rmse = (f[0].squeeze(-1) - y_test).pow(2).mean().sqrt()
    nll = -likelihood.log_predictive(f, y_test).mean()
    base_rmse = (y.mean() - y_test).pow(2).mean().sqrt()
    base_nll = (0.5 * torch.log(2 * math.pi * y.var()) + (y_test - y.mean()) ** 2 / (2 * y.var())).mean()
    assert rmse < 0.5 * base_rmse
    assert nll < base_nll


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

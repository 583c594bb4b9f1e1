"""MC dropout: fits tiny problems, masks come from the generator, options are validated."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from bdl_bench.likelihoods import Bernoulli, Gaussian, Likelihood
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector

NOISE_PRECISION = 100.0  # the regression data below has noise std 0.1
MLP = {"name": "mlp", "hidden": [32], "activation": "relu"}


def make_dropout(**overrides: object) -> Method:
    cfg = {"name": "dropout", "lr": 0.02, "dropout_rate": 0.05, "n_train_mc_samples": 1, "dropout_inputs": True}
    return build_method({**cfg, **overrides})


def init_(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """PyTorch's default Linear initialisation, drawn from ``generator`` (no global seeding)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            bound = 1 / math.sqrt(m.in_features)
            nn.init.uniform_(m.weight, -bound, bound, generator=generator)
            nn.init.uniform_(m.bias, -bound, bound, generator=generator)
    return model


def make_problem(in_features: int, likelihood: Likelihood, seed: int, model_cfg: dict | None = None) -> Problem:
    g = torch.Generator().manual_seed(seed)
    model = init_(build_model(model_cfg or MLP, in_features=in_features, out_features=1), g)
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


@pytest.mark.parametrize("dropout_inputs", [True, False])
def test_beats_training_mean_on_regression(dropout_inputs: bool) -> None:
    x, y, x_test, y_test = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    method = make_dropout(dropout_inputs=dropout_inputs)
    fit(method, make_problem(1, likelihood, seed=1), x, y)
    f = method.predict(x_test, 32)
    assert f.shape == (32, 100, 1)
    rmse = (f.mean(0).squeeze(-1) - y_test).pow(2).mean().sqrt()
    nll = -likelihood.log_predictive(f, y_test).mean()
    base_rmse = (y.mean() - y_test).pow(2).mean().sqrt()
    base_nll = (0.5 * torch.log(2 * math.pi * y.var()) + (y_test - y.mean()) ** 2 / (2 * y.var())).mean()
    assert rmse < 0.5 * base_rmse
    assert nll < base_nll


def test_beats_chance_on_two_classes() -> None:
    x, y, x_test, y_test = classification_data(0)
    method = make_dropout(n_train_mc_samples=2)
    fit(method, make_problem(2, Bernoulli(), seed=1), x, y)
    nll = -Bernoulli().log_predictive(method.predict(x_test, 32), y_test).mean()
    assert nll < 0.8 * math.log(2)


def test_masks_follow_the_generator() -> None:
    x, y, x_test, _ = regression_data(0)

    def run(seed: int) -> Tensor:
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=3)
        problem.generator.manual_seed(seed)
        method = make_dropout(dropout_rate=0.2)
        global_state = torch.get_rng_state()  # building the model above used it (nn.init)
        fit(method, problem, x, y, n_epochs=2)
        f = method.predict(x_test, 8)
        assert torch.equal(torch.get_rng_state(), global_state)
        return f

    first = run(10)
    assert_close(run(10), first, rtol=0, atol=0)
    assert not torch.allclose(run(11), first)
    assert not torch.allclose(first[0], first[1])  # each forward pass has its own masks


def test_mask_rate_and_inverted_scaling() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    method = make_dropout(dropout_rate=0.3)
    method.setup(problem)
    dropped = method._drop(torch.ones(200_000))
    assert_close((dropped == 0).double().mean().item(), 0.3, rtol=0, atol=0.005)
    assert_close(dropped[dropped != 0], torch.full_like(dropped[dropped != 0], 1 / 0.7))


@pytest.mark.parametrize(("dropout_inputs", "stochastic"), [(True, True), (False, False)])
def test_dropout_inputs_drops_the_first_layer_inputs(dropout_inputs: bool, stochastic: bool) -> None:
    """A single linear layer has no hidden layer: only input dropout makes its output random."""
    problem = make_problem(3, Bernoulli(), seed=0, model_cfg={"name": "logreg", "bias": True})
    method = make_dropout(dropout_rate=0.5, dropout_inputs=dropout_inputs)
    method.setup(problem)
    f = method.predict(torch.randn(6, 3, generator=torch.Generator().manual_seed(1)), 4)
    assert (not torch.allclose(f[0], f[1])) is stochastic


def test_ignores_the_models_own_dropout_modules() -> None:
    """A model built with nn.Dropout gives the same predictions as one without (same weights, same seed)."""
    x_test = regression_data(0)[2]
    predictions = []
    for extra in ({}, {"dropout": 0.5}):
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=4, model_cfg={**MLP, **extra})
        problem.model.train()
        method = make_dropout(dropout_rate=0.1)
        method.setup(problem)
        predictions.append(method.predict(x_test, 4))
    assert_close(predictions[1], predictions[0], rtol=0, atol=0)


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 1.5])
def test_bad_dropout_rate_raises(rate: float) -> None:
    with pytest.raises(ValueError, match=rf"0 < p < 1, got {rate}"):
        make_dropout(dropout_rate=rate)


@pytest.mark.parametrize(("option", "value"), [("lr", 0.0), ("n_train_mc_samples", 0), ("dropout_inputs", "yes")])
def test_bad_options_raise(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        make_dropout(**{option: value})


def test_refuses_models_it_cannot_run_layer_by_layer() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    wrapped = dataclasses.replace(problem, model=nn.ModuleDict({"net": problem.model}))
    with pytest.raises(ValueError, match="nn.Sequential"):
        make_dropout().setup(wrapped)


def test_state_dict_round_trip_gives_identical_next_step() -> None:
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    a, b, c = make_dropout(), make_dropout(), make_dropout()
    problem_a = make_problem(1, likelihood, seed=1)
    fit(a, problem_a, x, y, n_epochs=2)
    snapshot = a.state_dict()
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    b.setup(make_problem(1, likelihood, seed=2))
    b.load_state_dict(torch.load(buffer, weights_only=True))
    c.setup(make_problem(1, likelihood, seed=3))
    c.load_state_dict(snapshot)  # taken before ``a`` steps again: must be a copy, not a view
    for method in (a, b, c):
        method.problem.generator.manual_seed(5)
        method.train_step(x[:25], y[:25])
    assert_close(b.state_dict()["theta"], a.state_dict()["theta"], rtol=0, atol=0)
    assert_close(c.state_dict()["theta"], a.state_dict()["theta"], rtol=0, atol=0)

"""Per-example factors (of a stack of copies) reproduce per-example gradients computed densely by ``vmap(grad)``."""

from __future__ import annotations

import pytest
import torch
from _dense import per_example_gradients
from torch import nn

from bdl_bench.curvature import linear_layout
from bdl_bench.curvature.stacked import StackedFactors, gradient_columns, gradient_sum, stacked_factors
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.models.mlp import logistic_regression, mlp
from bdl_bench.models.params import flat_params, forward_with

F64 = torch.float64


def _problem(
    kind: str, generator: torch.Generator, n: int = 6
) -> tuple[nn.Module, Likelihood, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # nn.init only; data and parameters come from the generator
    if kind == "mlp_categorical":
        model = mlp(in_features=3, out_features=2, hidden=[5], activation="tanh")
        y = torch.randint(0, 2, (n,), generator=generator)
        likelihood: Likelihood = Categorical()
        n_in = 3
    elif kind == "mlp_gaussian":
        model = mlp(in_features=4, out_features=1, hidden=[3, 5], activation="relu")
        y = torch.randn(n, generator=generator, dtype=F64)
        likelihood = Gaussian(noise_precision=2.5)
        n_in = 4
    elif kind == "logreg":
        model = logistic_regression(in_features=2, out_features=1, bias=True)
        y = torch.randint(0, 2, (n,), generator=generator).to(F64)
        likelihood = Bernoulli()
        n_in = 2
    elif kind == "no_bias":
        model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Sigmoid(), nn.Linear(4, 3))
        y = torch.randint(0, 3, (n,), generator=generator)
        likelihood = Categorical()
        n_in = 3
    else:
        raise ValueError(kind)
    x = torch.randn(n, n_in, generator=generator, dtype=F64)
    return model.to(F64), likelihood, x, y


KINDS = ["mlp_categorical", "mlp_gaussian", "logreg", "no_bias"]


def _factors(model: nn.Module, thetas: torch.Tensor, x, y, likelihood: Likelihood, shared: bool) -> StackedFactors:
    """The factors of a stack of one copy at the samples ``thetas`` ``(S, D)``."""
    layout = linear_layout(model)
    return stacked_factors(model, layout, thetas[None], x[None], y[None], [likelihood], share_first_input=shared)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_samples", [1, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["repeated_input", "shared_input"])
def test_factors_reproduce_dense_per_example_gradients(
    kind: str, n_samples: int, shared: bool, generator: torch.Generator
) -> None:
    model, likelihood, x, y = _problem(kind, generator)
    n_params = flat_params(model).numel()
    thetas = torch.randn(n_samples, n_params, generator=generator, dtype=F64)
    factors = _factors(model, thetas, x, y, likelihood, shared)
    dense = per_example_gradients(model, thetas, x, y, likelihood)  # (D, S·M)
    layout = linear_layout(model)
    assert factors.losses.shape == (1, n_samples, x.shape[0])
    torch.testing.assert_close(gradient_columns(factors, layout)[0].mT, dense)
    torch.testing.assert_close(gradient_sum(factors, layout)[0], dense.sum(1))
    # losses and outputs are those of the model evaluated at each theta
    for s in range(n_samples):
        f = forward_with(model, thetas[s], x)
        torch.testing.assert_close(factors.outputs[0, s], f)
        torch.testing.assert_close(factors.losses[0, s], likelihood.nll(f, y))


def test_single_theta_equals_autograd_of_summed_loss(generator: torch.Generator) -> None:
    model, likelihood, x, y = _problem("mlp_categorical", generator)
    theta = flat_params(model).requires_grad_(True)
    likelihood.nll(forward_with(model, theta, x), y).sum().backward()
    factors = _factors(model, theta.detach()[None], x, y, likelihood, shared=True)
    torch.testing.assert_close(gradient_sum(factors, linear_layout(model))[0], theta.grad)


def test_layout_follows_parameter_order() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False), nn.Tanh(), nn.Linear(2, 1))
    layout = linear_layout(model)
    assert layout.n_params == 16 + 8 + 3
    assert [(s.weight_offset, s.bias_offset) for s in layout.slots] == [(0, 12), (16, None), (24, 26)]
    assert [s.module_index for s in layout.slots] == [0, 2, 4]


@pytest.mark.parametrize(
    "model, match",
    [
        (nn.Linear(3, 2), "nn.Sequential"),
        (nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1)), "LayerNorm"),
        (nn.Sequential(nn.ReLU()), "at least one nn.Linear"),
        (nn.Sequential(*[nn.Linear(3, 3)] * 2), "reuses"),
    ],
)
def test_unsupported_models_are_refused(model: nn.Module, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        linear_layout(model)

"""The flat parameter vector's views: the same values and gradients as the model's own parameters."""

from __future__ import annotations

import pytest
import torch

from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, forward_with, unflatten, unflatten_stacked


def _lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = {"name": "lenet", "image_size": 8, "channels": [3, 4], "hidden": 6, "dropout": 0.0}
    return build_model(cfg, in_features=1, out_features=5).double()


def test_forward_with_gives_the_models_gradient_bit_for_bit() -> None:
    """A backward through ``unflatten``'s split views gives exactly autograd's gradient of the model itself."""
    model = _lenet()
    x = torch.randn(9, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model(x).square().sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    theta = flat_params(model).requires_grad_(True)
    (grad,) = torch.autograd.grad(forward_with(model, theta, x).square().sum(), theta)
    assert torch.equal(grad, expected)


def test_views_and_their_errors() -> None:
    model = _lenet()
    theta = flat_params(model)
    for p, view in zip(model.parameters(), unflatten(model, theta).values()):
        assert view.shape == p.shape and torch.equal(view, p.detach()) and view.data_ptr() >= theta.data_ptr()
    stacked = torch.stack([theta, 2 * theta])
    for p, view in zip(model.parameters(), unflatten_stacked(model, stacked).values()):
        assert torch.equal(view[1], 2 * p.detach())
    with pytest.raises(ValueError, match="model has"):
        unflatten(model, theta[:-1])
    with pytest.raises(ValueError, match="model has"):
        unflatten_stacked(model, stacked[:, 1:])

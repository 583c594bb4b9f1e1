"""Deep ensemble: distinct initialisations from the generator, beats one network's baseline, refusals, checkpoints."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Method, Problem
from bdl_bench.methods.ensemble import default_init
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, prior_precision_vector

NOISE_PRECISION = 100.0


def make(n_members: int = 4, lr: float = 0.02) -> Method:
    return build_method({"name": "ensemble", "n_members": n_members, "lr": lr})


def problem(seed: int = 1) -> Problem:
    g = torch.Generator().manual_seed(seed)
    model = build_model({"name": "mlp", "hidden": [16], "activation": "tanh"}, in_features=1, out_features=1)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(default_init(model, g), model.parameters())
    return Problem(model, Gaussian(NOISE_PRECISION), 60, prior_precision_vector(model, 1.0, None), g)


def data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(120, 1, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(120, generator=g)
    return x[:60], y[:60], x[60:], y[60:]


def test_members_start_apart_and_member_zero_is_the_model() -> None:
    p = problem()
    method = make()
    method.setup(p)
    assert_close(method.thetas[0].detach(), flat_params(p.model), rtol=0, atol=0)
    assert min(float((method.thetas[0] - method.thetas[m]).norm()) for m in (1, 2, 3)) > 0.5
    bound = 1.0  # fan-in 1 in the first layer: U(-1, 1)
    assert float(method.thetas[1:, :16].abs().max()) <= bound


def test_default_init_uses_only_the_generator() -> None:
    model = problem().model
    state = torch.get_rng_state()
    a = default_init(model, torch.Generator().manual_seed(5))
    b = default_init(model, torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), state)
    assert_close(a, b, rtol=0, atol=0)


def test_fits_regression_and_the_mixture_beats_the_baseline() -> None:
    x, y, x_test, y_test = data()
    method = make()
    method.setup(problem())
    method.fit(x, y, n_epochs=150, batch_size=30, data_generator=torch.Generator().manual_seed(7))
    f = method.predict(x_test, 8)
    assert f.shape == (8, 60, 1)
    assert_close(f[4:], f[:4], rtol=0, atol=0)  # sample s is member s mod M
    assert float((f[0] - f[1]).abs().max()) > 0  # members differ
    likelihood = Gaussian(NOISE_PRECISION)
    nll = -likelihood.log_predictive(f, y_test).mean()
    base = (0.5 * torch.log(2 * math.pi * y.var()) + (y_test - y.mean()) ** 2 / (2 * y.var())).mean()
    assert nll < base


@pytest.mark.parametrize(("key", "value"), [("n_members", 0), ("n_members", 1.5), ("lr", 0.0)])
def test_bad_values_are_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=key):
        build_method({"name": "ensemble", "n_members": 3, "lr": 0.1, key: value})


def test_checkpoint_round_trip() -> None:
    x, y, _, _ = data()
    a, b = make(), make()
    a.setup(problem())
    a.fit(x, y, n_epochs=2, batch_size=30, data_generator=torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.setup(problem(seed=2))
    b.load_state_dict(torch.load(buffer, weights_only=True))
    for m in (a, b):
        m.train_step(x[:20], y[:20])
    assert_close(b.state_dict()["thetas"], a.state_dict()["thetas"], rtol=0, atol=0)


def test_members_are_independent_adam_fits() -> None:
    """Training M members together (summed losses, one Adam over the (M, D) tensor) moves each member exactly
    as a one-member ensemble started from its parameters would move."""
    x, y, _, _ = data()
    together = make(n_members=3)
    together.setup(problem())
    start = together.thetas.detach().clone()
    for _ in range(3):
        together.train_step(x[:20], y[:20])
    for m in range(3):
        alone = make(n_members=1)
        alone.setup(problem())
        with torch.no_grad():
            alone.thetas.copy_(start[m : m + 1])
        for _ in range(3):
            alone.train_step(x[:20], y[:20])
        assert_close(together.thetas[m], alone.thetas[0], rtol=1e-6, atol=1e-7)
        assert not torch.equal(together.thetas[m], start[m])

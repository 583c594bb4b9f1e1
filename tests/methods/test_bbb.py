"""Bayes by Backprop: fits tiny problems, local reparameterisation and KL against dense twins."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from _toy import NOISE_PRECISION, check_beats_training_mean, classification_data, fit, make_problem, regression_data
from torch import Tensor, nn
from torch.distributions import MultivariateNormal, kl_divergence
from torch.testing import assert_close

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.likelihoods import Bernoulli, Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods._diag_vi import kl_diag_to_prior, local_reparam_linear
from bdl_bench.methods.base import Method

ESTIMATORS = ["reparam", "local_reparam"]


def make_bbb(**overrides: object) -> Method:
    cfg = {"name": "bbb", "lr": 0.02, "n_train_mc_samples": 4, "estimator": "local_reparam", "init_std": 0.01}
    return build_method({**cfg, **overrides})


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_beats_training_mean_on_regression(estimator: str) -> None:
    check_beats_training_mean(make_bbb(estimator=estimator))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_beats_chance_on_two_classes(estimator: str) -> None:
    x, y, x_test, y_test = classification_data(0)
    method = make_bbb(estimator=estimator)
    fit(method, make_problem(2, Bernoulli(), seed=1), x, y)
    nll = -Bernoulli().log_predictive(method.predict(x_test, 32), y_test).mean()
    assert nll < 0.8 * math.log(2)


def test_local_reparam_has_moments_of_weight_sampling() -> None:
    g = torch.Generator().manual_seed(0)
    dt = torch.float64
    a = torch.randn(4, 3, generator=g, dtype=dt)  # layer inputs
    w_mean, w_std = torch.randn(2, 3, generator=g, dtype=dt), torch.rand(2, 3, generator=g, dtype=dt) + 0.1
    b_mean, b_std = torch.randn(2, generator=g, dtype=dt), torch.rand(2, generator=g, dtype=dt) + 0.1
    n = 200_000
    local = local_reparam_linear(a.expand(n, 4, 3), w_mean, w_std**2, b_mean, b_std**2, g)  # (n, 4, 2)
    w = w_mean + w_std * torch.randn(n, 2, 3, generator=g, dtype=dt)
    b = b_mean + b_std * torch.randn(n, 2, generator=g, dtype=dt)
    explicit = torch.einsum("ni,soi->sno", a, w) + b[:, None, :]  # (n, 4, 2)
    exact_mean = a @ w_mean.T + b_mean
    exact_var = a**2 @ (w_std**2).T + b_std**2
    mean_tol = 6 * (exact_var.max() / n).sqrt().item()
    for samples in (local, explicit):
        assert_close(samples.mean(0), exact_mean, rtol=0, atol=mean_tol)
        assert_close(samples.var(0), exact_var, rtol=0.03, atol=0)


def test_method_local_and_weight_sampling_agree_on_one_layer() -> None:
    """The method's own two forward passes: same output moments on a single linear layer."""
    problem = make_problem(3, Bernoulli(), seed=0, model_cfg={"name": "logreg", "bias": True})
    method = make_bbb(estimator="local_reparam", init_std=0.3)
    method.setup(problem)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        local = method._outputs_local(x[None], 100_000)[0]
        explicit = method._outputs_reparam(x[None], 100_000)[0]
    assert local.shape == explicit.shape == (100_000, 5, 1)
    assert_close(local.mean(0), explicit.mean(0), rtol=0, atol=0.02)
    assert_close(local.var(0), explicit.var(0), rtol=0.03, atol=0)


def test_closed_form_kl_matches_dense() -> None:
    g = torch.Generator().manual_seed(0)
    dt = torch.float64
    mean = torch.randn(7, generator=g, dtype=dt)
    std = torch.rand(7, generator=g, dtype=dt) + 0.05
    prior_precision = torch.rand(7, generator=g, dtype=dt) * 3 + 0.1
    dense = kl_divergence(
        MultivariateNormal(mean, covariance_matrix=torch.diag(std**2)),
        MultivariateNormal(torch.zeros(7, dtype=dt), precision_matrix=torch.diag(prior_precision)),
    )
    assert_close(kl_diag_to_prior(mean, std, prior_precision), dense)


def test_posterior_and_kl_to_prior() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    method = make_bbb(init_std=0.05)
    method.setup(problem)
    q = method.posterior()
    assert isinstance(q, DiagGaussian)
    assert_close(q.mean, torch.nn.utils.parameters_to_vector(problem.model.parameters()).detach())
    assert_close(q.prec_diag, torch.full_like(q.mean, 0.05**-2))
    dense = kl_divergence(
        MultivariateNormal(q.mean, precision_matrix=torch.diag(q.prec_diag)),
        MultivariateNormal(torch.zeros_like(q.mean), precision_matrix=torch.diag(problem.prior_precision)),
    )
    assert_close(method.kl_to_prior(), dense, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_randomness_comes_from_the_generator(estimator: str) -> None:
    x, y, x_test, _ = regression_data(0)

    def run(seed: int) -> Tensor:
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=3)
        problem.generator.manual_seed(seed)
        method = make_bbb(estimator=estimator)
        global_state = torch.get_rng_state()  # building the model above used it (nn.init)
        fit(method, problem, x, y, n_epochs=2)
        f = method.predict(x_test, 8)
        assert torch.equal(torch.get_rng_state(), global_state)
        return f

    first = run(10)
    assert_close(run(10), first, rtol=0, atol=0)
    assert not torch.allclose(run(11), first)
    assert not torch.allclose(first[0], first[1])  # the samples differ


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("estimator", "score_function", r"'score_function'.*reparam, local_reparam"),
        ("lr", 0.0, "lr"),
        ("init_std", -1.0, "init_std"),
        ("n_train_mc_samples", 0, "n_train_mc_samples"),
    ],
)
def test_bad_options_raise(option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_bbb(**{option: value})


def test_refuses_unsupported_models() -> None:
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    with_dropout = {"name": "mlp", "hidden": [8], "activation": "relu", "dropout": 0.1}
    with pytest.raises(ValueError, match="dropout"):
        make_bbb(estimator="reparam").setup(make_problem(1, likelihood, seed=0, model_cfg=with_dropout))
    problem = make_problem(1, likelihood, seed=0)
    wrapped = dataclasses.replace(problem, model=nn.ModuleDict({"net": problem.model}))
    with pytest.raises(ValueError, match="nn.Sequential"):
        make_bbb(estimator="local_reparam").setup(wrapped)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_state_dict_round_trip_gives_identical_next_step(estimator: str) -> None:
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    a, b = make_bbb(estimator=estimator), make_bbb(estimator=estimator)
    problem_a, problem_b = make_problem(1, likelihood, seed=1), make_problem(1, likelihood, seed=2)
    fit(a, problem_a, x, y, n_epochs=2)
    snapshot = a.state_dict()
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    b.setup(problem_b)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    for method, problem in ((a, problem_a), (b, problem_b)):
        problem.generator.manual_seed(5)
        method.train_step(x[:25], y[:25])
    for key in ("mean", "rho"):
        assert_close(b.state_dict()[key], a.state_dict()[key], rtol=0, atol=0)
    # the snapshot is a copy: stepping ``a`` did not change it
    c = make_bbb(estimator=estimator)
    c.setup(make_problem(1, likelihood, seed=3))
    c.load_state_dict(snapshot)
    c.problem.generator.manual_seed(5)
    c.train_step(x[:25], y[:25])
    assert_close(c.state_dict()["rho"], a.state_dict()["rho"], rtol=0, atol=0)


def test_fused_adam_single_and_stacked_steps_equal_the_plain_adam_and_survive_a_resume() -> None:
    """BBB's Adam is the fused kernel (bdl_bench.optim.adam) for one run and for stacked copies, a resumed
    run keeps it, and its steps are the plain Adam's up to float rounding."""
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    fused, plain = make_bbb(), make_bbb()
    fused.setup(make_problem(1, likelihood, seed=1))
    plain.setup(make_problem(1, likelihood, seed=1))
    plain.optimizer = torch.optim.Adam([plain.mean, plain.rho], lr=plain.lr)
    assert fused.optimizer.param_groups[0]["fused"] and not plain.optimizer.param_groups[0]["fused"]
    for _ in range(5):
        for method in (fused, plain):
            method.train_step(x[:25], y[:25])
    for key in ("mean", "rho"):
        assert_close(fused.state_dict()[key], plain.state_dict()[key], rtol=1e-5, atol=1e-7)
    resumed = make_bbb()
    resumed.setup(make_problem(1, likelihood, seed=2))
    resumed.load_state_dict(plain.state_dict())  # a checkpoint of the plain kernel
    assert resumed.optimizer.param_groups[0]["fused"]
    stacked = make_bbb()
    stacked.setup_stack([make_problem(1, likelihood, seed=1) for _ in range(2)])
    assert stacked.optimizer.param_groups[0]["fused"]


def test_lr_decay_steps_at_lr_over_one_plus_t_to_the_decay() -> None:
    """``lr_decay`` (the SLANG authors' ScheduledAdam): update t uses lr / (1 + t)^alpha; ``None`` keeps lr."""
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    used: dict[object, list[float]] = {}
    for lr_decay in (None, 0.25):
        method = make_bbb(lr_decay=lr_decay)
        method.setup(make_problem(1, likelihood, seed=1))
        step = method.optimizer.step

        def recording(*args, method=method, key=lr_decay, step=step):  # noqa: ANN001, ANN002, ANN202
            used.setdefault(key, []).append(method.optimizer.param_groups[0]["lr"])
            return step(*args)

        method.optimizer.step = recording
        for _ in range(3):
            method.train_step(x[:20], y[:20])
    assert used[None] == [0.02] * 3
    assert used[0.25] == pytest.approx([0.02 / (1 + t) ** 0.25 for t in (1, 2, 3)])

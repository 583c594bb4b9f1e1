"""VOGN: one step against a dense twin, convergence to exact VI, curvature, refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _logistic import N, logistic_data, logistic_problem
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.distributions import MultivariateNormal, kl_divergence
from torch.testing import assert_close

from bdl_bench.curvature.per_example import linear_layout
from bdl_bench.gaussians import DiagGaussian, FullGaussian, sym_kl
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import CannotStack, Method, NonFiniteLossError, Problem
from bdl_bench.methods.vogn import VOGN, Curvature, factored_terms, per_example_terms
from bdl_bench.models import build_model
from bdl_bench.models.params import forward_with

F64 = torch.float64
COMBOS = [(c, k) for c in ("full", "diag") for k in ("hessian", "ef")]
CONF = Path(__file__).resolve().parents[2] / "conf" / "method" / "vogn.yaml"


def make_vogn(**overrides: object) -> Method:
    cfg = {
        "name": "vogn",
        "covariance": "full",
        "curvature": "hessian",
        "lr": 0.05,
        "beta": 0.05,
        "decay": 0.51,
        "n_train_mc_samples": 12,
        "init_prec": 1.0,
    }
    return build_method({**cfg, **overrides})


def fit(method: Method, problem: Problem, *, n_epochs: int, batch_size: int) -> None:
    x, y, _, _ = logistic_data()
    method.setup(problem)
    method.fit(x, y, n_epochs=n_epochs, batch_size=batch_size, data_generator=torch.Generator().manual_seed(5))


def exact_vi_posterior(covariance: str) -> FullGaussian | DiagGaussian:
    method = build_method(
        {
            "name": "exact_vi",
            "covariance": covariance,
            "expectation": "quadrature",
            "n_quadrature": 32,
            "max_iter": 500,
            "tolerance": 1e-9,
        }
    )
    fit(method, logistic_problem(), n_epochs=1, batch_size=N)
    return method.posterior()


@pytest.mark.parametrize(("covariance", "curvature"), COMBOS)
def test_update_matches_a_dense_twin(covariance: str, curvature: str) -> None:
    """Step 2 (t = 1, a dense precision after step 1) on a minibatch of 20 of N = 60, K = 3 samples."""
    problem = logistic_problem()
    method = make_vogn(covariance=covariance, curvature=curvature, n_train_mc_samples=3, lr=0.3, beta=0.2)
    assert isinstance(method, VOGN)
    method.setup(problem)
    x, y, _, _ = logistic_data()
    method.train_step(x[:20], y[:20])
    state = method.state
    assert state.mean.shape == (1, 3)  # a single run is the stack of one copy
    mean0 = state.mean[0]
    twin_gen = torch.Generator()
    twin_gen.set_state(problem.generator.get_state())
    out = method.train_step(x[20:40], y[20:40])

    full = covariance == "full"
    prec = state.precision[0] if full else torch.diag(state.precision[0])
    eps = torch.randn((3, 3), generator=twin_gen, dtype=F64)
    chol = torch.linalg.cholesky(prec)
    thetas = [mean0 + torch.linalg.solve(chol.T, e) for e in eps]  # θ = μ + L^{-T} ε, S = L Lᵀ
    xb, yb = x[20:40], y[20:40]
    design = torch.cat([xb, torch.ones(20, 1, dtype=F64)], 1)
    g_hat, h_hat, nll = torch.zeros(3, dtype=F64), torch.zeros(3, 3, dtype=F64), 0.0
    for theta in thetas:
        for xi, yi in zip(design, yb):
            th = theta.clone().requires_grad_(True)
            loss = nn.functional.binary_cross_entropy_with_logits(xi @ th, yi)
            (gi,) = torch.autograd.grad(loss, th)
            g_hat += gi
            h_hat += (
                torch.outer(gi, gi)
                if curvature == "ef"
                else torch.autograd.functional.hessian(
                    lambda t, xi=xi, yi=yi: nn.functional.binary_cross_entropy_with_logits(xi @ t, yi), theta
                )
            )
            nll += loss.item()
    g_hat, h_hat = g_hat * N / (20 * 3), h_hat * N / (20 * 3)
    lam = problem.prior_precision
    alpha, beta = 0.3 / (1 + 2**0.51), 0.2 / (1 + 2**0.51)  # step t = 2 of α/(1 + t^decay)
    if not full:
        h_hat = torch.diag(h_hat.diagonal())
    new_prec = (1 - beta) * prec + beta * (h_hat + torch.diag(lam))
    new_mean = mean0 - alpha * torch.linalg.solve(new_prec, g_hat + lam * mean0)
    assert method.state.step == 2
    assert_close(method.state.mean[0], new_mean)
    assert_close(method.state.precision[0], new_prec if full else new_prec.diagonal())
    q = MultivariateNormal(mean0, precision_matrix=prec)
    kl = float(kl_divergence(q, MultivariateNormal(torch.zeros(3, dtype=F64), precision_matrix=torch.diag(lam))))
    if full:  # the step's loss estimates the KL's trace term tr(diag(λ) S⁻¹) from its samples
        trace = torch.linalg.solve(prec, torch.diag(lam)).trace()
        kl += 0.5 * float(torch.stack([(th - mean0).square() @ lam for th in thetas]).mean() - trace)
    assert_close(float(out["nll"]), nll / 60)
    assert_close(float(out["loss"]), nll / 60 + kl / N)


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_hessian_version_converges_to_exact_vi_in_its_family(covariance: str) -> None:
    """SLANG Table 1 protocol (α = β = 0.05, decay 0.51, 12 samples, minibatch 20 of 60), 1000 epochs.

    With the exact Hessian the fixed point of the update is the stationary point of the ELBO over
    the family (full: exact VI; diag: mean-field exact VI), so only Monte Carlo noise remains.
    """
    exact = exact_vi_posterior(covariance)
    method = make_vogn(covariance=covariance)
    fit(method, logistic_problem(), n_epochs=1000, batch_size=20)
    q = method.posterior()
    assert isinstance(q, FullGaussian if covariance == "full" else DiagGaussian)
    # For scale: sym-KL(prior, exact) ≈ 22, sym-KL(mean-field exact, full exact) ≈ 0.05.
    prior = DiagGaussian(torch.zeros(3, dtype=F64), logistic_problem().prior_precision)
    assert float(sym_kl(prior, exact)) > 10
    assert float(sym_kl(exact_vi_posterior("diag"), exact_vi_posterior("full"))) > 0.04
    assert float(sym_kl(q, exact)) < 2e-3


@pytest.mark.parametrize(("covariance", "curvature"), [("diag", "hessian"), ("diag", "ef"), ("full", "ef")])
def test_variants_beat_the_base_rate_with_positive_precisions(covariance: str, curvature: str) -> None:
    problem = logistic_problem()
    method = make_vogn(covariance=covariance, curvature=curvature, n_train_mc_samples=4)
    fit(method, problem, n_epochs=40, batch_size=20)
    (precision,) = method.state.precision
    assert bool(torch.isfinite(precision).all())
    if covariance == "diag":
        assert precision.shape == (3,) and bool((precision > 0).all())
    else:
        assert precision.shape == (3, 3) and bool((torch.linalg.eigvalsh(precision) > 0).all())
    _, y, x_test, y_test = logistic_data()
    f = method.predict(x_test, 64)
    assert f.shape == (64, N, 1)
    nll = -Bernoulli().log_predictive(f, y_test).mean()
    rate = y.mean()
    base = -(y_test * rate.log() + (1 - y_test) * (1 - rate).log()).mean()
    assert nll < base - 0.05
    assert method.state.step == 40 * 3


def test_kl_to_prior_matches_torch_distributions_and_state_round_trips() -> None:
    for covariance in ("full", "diag"):
        problem = logistic_problem()
        method = make_vogn(covariance=covariance)
        fit(method, problem, n_epochs=3, batch_size=20)
        q = method.posterior()
        dense = q.to_dense().precision
        ref = kl_divergence(
            MultivariateNormal(q.mean, precision_matrix=dense),
            MultivariateNormal(torch.zeros(3, dtype=F64), precision_matrix=torch.diag(problem.prior_precision)),
        )
        assert_close(method.kl_to_prior(), ref)
        fresh = make_vogn(covariance=covariance)
        fresh.setup(logistic_problem(seed=9))
        fresh.load_state_dict(method.state_dict())
        assert fresh.state.step == method.state.step
        assert_close(fresh.state.precision, method.state.precision)
        assert_close(fresh.state.mean, method.state.mean)


def test_hessian_curvature_is_the_exact_hessian_for_logistic_regression() -> None:
    problem = logistic_problem()
    x, y, _, _ = logistic_data()
    theta = torch.tensor([0.4, -0.3, 0.2], dtype=F64)

    def total_nll(t: Tensor) -> Tensor:
        return problem.likelihood.nll(forward_with(problem.model, t, x), y).sum()

    hess = torch.autograd.functional.hessian(total_nll, theta)
    _, grads, curv = per_example_terms(
        problem.model, problem.likelihood, theta, x, y, curvature=Curvature.HESSIAN, full=True
    )
    assert_close(curv, hess)
    assert_close(grads.sum(0), torch.func.grad(total_nll)(theta))
    _, _, diag = per_example_terms(problem.model, problem.likelihood, theta, x, y, curvature="hessian", full=False)
    assert_close(diag, hess.diagonal())
    _, ef_grads, ef = per_example_terms(problem.model, problem.likelihood, theta, x, y, curvature="ef", full=True)
    assert_close(ef_grads, grads)
    assert_close(ef, grads.T @ grads)


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian", "categorical"])
@pytest.mark.parametrize("curvature", ["ef", "hessian"])
def test_factored_terms_match_the_torch_func_twin(kind: str, curvature: str, generator: torch.Generator) -> None:
    """The fast layer-factor path against per-sample ``vmap``/``jacrev``, K = 3 samples, a 2-4-out MLP, for two
    stacked copies with their own samples, data and likelihood (Gaussians: their own noise precision)."""
    out = 3 if kind == "categorical" else 1
    likelihoods = {
        "bernoulli": [Bernoulli(), Bernoulli()],
        "gaussian": [Gaussian(2.0), Gaussian(0.5)],
        "categorical": [Categorical(), Categorical()],
    }[kind]
    model = build_model({"name": "mlp", "hidden": [4], "activation": "tanh"}, in_features=2, out_features=out).to(F64)
    n_params = sum(p.numel() for p in model.parameters())
    thetas = torch.randn(2, 3, n_params, generator=generator, dtype=F64)
    x = torch.randn(2, 5, 2, generator=generator, dtype=F64)
    y = (
        torch.randint(0, out, (2, 5), generator=generator)
        if kind == "categorical"
        else (torch.rand(2, 5, generator=generator, dtype=F64) < 0.5).to(F64)
    )
    layout = linear_layout(model)
    for full in (True, False):
        nll, g_sum, h_sum = factored_terms(model, layout, likelihoods, thetas, x, y, curvature=curvature, full=full)
        assert nll.shape == (2,) and g_sum.shape == (2, n_params)
        for r, lik in enumerate(likelihoods):
            terms = [per_example_terms(model, lik, t, x[r], y[r], curvature=curvature, full=full) for t in thetas[r]]
            assert_close(nll[r], torch.stack([t[0].mean() for t in terms]).mean())
            assert_close(g_sum[r], sum(t[1].sum(0) for t in terms))
            assert_close(h_sum[r], sum(t[2] for t in terms))


def test_models_outside_the_linear_layout_take_the_torch_func_path() -> None:
    """A non-Sequential wrapper of the same layer: identical steps through the fallback path."""

    class Wrapped(nn.Module):
        def __init__(self, layer: nn.Linear) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: Tensor) -> Tensor:
            return self.layer(x)

    x, y, _, _ = logistic_data()
    states = []
    for wrap in (False, True):
        problem = logistic_problem()
        if wrap:
            problem = Problem(
                model=Wrapped(problem.model[0]),
                likelihood=problem.likelihood,
                n_data=N,
                prior_precision=problem.prior_precision,
                generator=problem.generator,
            )
        method = make_vogn(n_train_mc_samples=3)
        method.setup(problem)
        assert (method._layout is None) == wrap
        for _ in range(3):
            method.train_step(x[:20], y[:20])
        states.append(method.state)
        if wrap:  # a single run only: several copies of it cannot be stacked
            with pytest.raises(CannotStack, match="networks of nn.Linear layers"):
                make_vogn(n_train_mc_samples=3).setup_stack([problem, problem])
    assert_close(states[0].mean, states[1].mean)
    assert_close(states[0].precision, states[1].precision)


def test_ggn_of_a_small_mlp_matches_dense_jacobians(generator: torch.Generator) -> None:
    model = build_model({"name": "mlp", "hidden": [5], "activation": "tanh"}, in_features=2, out_features=3).to(F64)
    lik = Categorical()
    theta = 0.5 * torch.randn(sum(p.numel() for p in model.parameters()), generator=generator, dtype=F64)
    x = torch.randn(6, 2, generator=generator, dtype=F64)
    y = torch.randint(0, 3, (6,), generator=generator)
    _, grads, curv = per_example_terms(model, lik, theta, x, y, curvature="hessian", full=True)
    ref = torch.zeros_like(curv)
    for i in range(6):
        jac = torch.autograd.functional.jacobian(lambda t, i=i: forward_with(model, t, x[i : i + 1])[0], theta)
        p = torch.softmax(forward_with(model, theta, x[i : i + 1])[0], -1)
        ref += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac
        g_i = torch.func.grad(lambda t, i=i: lik.nll(forward_with(model, t, x[i : i + 1]), y[i : i + 1]).sum())(theta)
        assert_close(grads[i], g_i)
    assert_close(curv, ref)


def test_non_finite_values_raise_instead_of_passing_silently() -> None:
    problem = logistic_problem()
    method = make_vogn(covariance="diag")
    method.setup(problem)
    x, y, _, _ = logistic_data()
    x = x.clone()
    x[3, 0] = float("nan")
    before = method.state
    out = method.train_step(x[:20], y[:20])  # reported on the device, not raised: no host read per step
    assert math.isnan(float(out["loss"]))
    assert torch.equal(method.state.mean, before.mean) and torch.equal(method.state.precision, before.precision)
    with pytest.raises(NonFiniteLossError, match=r"method 'vogn': non-finite loss nan at epoch 1, step 1"):
        method.fit(x[:20], y[:20], n_epochs=1, batch_size=20, data_generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="non-finite"):
        bad = method.state_dict()
        bad["precision"] = torch.full_like(bad["precision"], float("nan"))
        method.load_state_dict(bad)


def test_full_covariance_refuses_large_models() -> None:
    mlp = build_model({"name": "mlp", "hidden": [100], "activation": "relu"}, in_features=60, out_features=1)
    problem = logistic_problem(model=mlp.to(F64))
    with pytest.raises(ValueError, match="D=6201"):
        make_vogn(covariance="full").setup(problem)
    make_vogn(covariance="diag").setup(problem)  # mean-field is fine


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("covariance", "kron", "choices: full, diag"),
        ("curvature", "fisher", "choices: ef, hessian"),
        ("lr", 0.0, "lr"),
        ("beta", 1.5, "beta"),
        ("decay", -1.0, "decay"),
        ("n_train_mc_samples", 0, "n_train_mc_samples"),
        ("init_prec", -1.0, "init_prec"),
    ],
)
def test_bad_options_are_refused(key: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_vogn(**{key: value})


def test_yaml_builds_the_method() -> None:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF), resolve=True)
    assert cfg["name"] == "vogn" and cfg["n_train_mc_samples"] == 12
    method = build_method(cfg)
    assert isinstance(method, VOGN) and method.curvature is Curvature.HESSIAN


def test_full_state_carries_the_cholesky_factor_and_the_step_kl_estimate_is_unbiased() -> None:
    """covariance=full: the state keeps the Cholesky factor of its precision (the next step samples with
    it); the training loss's KL estimates the trace term from samples, whose mean is the exact KL."""
    from bdl_bench.methods.vogn import _kl_to_prior

    torch.manual_seed(0)
    model = build_model({"name": "logreg", "bias": True}, in_features=3, out_features=1).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,)).double()
    problem = Problem(
        model, Bernoulli(), 40, torch.full((4,), 2.0, dtype=torch.float64), torch.Generator().manual_seed(1)
    )
    method = build_method(
        {"name": "vogn", "covariance": "full", "curvature": "hessian", "lr": 0.1, "beta": 0.1}
        | {"decay": 0.0, "n_train_mc_samples": 2, "init_prec": 1.0}
    )
    method.setup(problem)
    for _ in range(3):
        method.train_step(x, y)
    state = method.state
    assert state.chol is not None
    torch.testing.assert_close(state.chol @ state.chol.mT, state.precision)
    lam = problem.prior_precision
    exact = method.kl_to_prior()
    eps = torch.randn(200_000, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    noise = torch.linalg.solve_triangular(state.chol, eps, upper=False, left=False)  # rows ~ N(0, S^-1)
    estimate = _kl_to_prior(state, state.chol, lam, noise)
    assert float(estimate) == pytest.approx(float(exact), rel=5e-3)


@pytest.mark.parametrize("n_copies", [1, 2])
def test_full_covariance_divergence_names_the_step_and_the_copy(n_copies: int) -> None:
    """A single run's error names the step; a stack's also names the copy."""
    from bdl_bench.methods.vogn import _cholesky

    method = make_vogn(covariance="full")
    method.setup_stack([logistic_problem()] * n_copies)
    x, y, _, _ = logistic_data()
    xs, ys = torch.stack([x[:20]] * n_copies), torch.stack([y[:20]] * n_copies)
    xs[-1, 3, 0] = float("nan")
    where = " in stacked copy 1" if n_copies == 2 else ""
    with pytest.raises(NonFiniteLossError, match=rf"'vogn': non-finite precision or gradient{where} at step 1$"):
        method.stack_step(xs, ys)
    eye = torch.eye(3, dtype=F64)
    precisions = torch.stack([eye, -eye][-n_copies:]) if n_copies == 2 else -eye[None]
    which = " of stacked copy 1" if n_copies == 2 else ""
    with pytest.raises(NonFiniteLossError, match=rf"precision{which} is not positive definite after step 4 \(leading"):
        _cholesky(precisions, 4)


def test_a_stacks_checkpoint_resumes_every_copy_and_a_single_runs_old_one_loads() -> None:
    """A stack's state_dict holds all its copies (the stacked job's checkpoint); a fresh stack that loads it takes
    the same next step. A single run's checkpoint of the copy-less form ``(D,)`` still loads."""
    x, y, _, _ = logistic_data()
    xs, ys = torch.stack([x[:20], x[20:40]]), torch.stack([y[:20], y[20:40]])
    method = make_vogn(covariance="full")
    method.setup_stack([logistic_problem(), logistic_problem()])
    method.stack_step(xs, ys)
    saved = method.state_dict()
    assert saved["mean"].shape == (2, 3) and saved["precision"].shape == (2, 3, 3)
    resumed = make_vogn(covariance="full")
    resumed.setup_stack([logistic_problem(), logistic_problem()])
    resumed.load_state_dict(saved)
    resumed.problem.generator.set_state(method.problem.generator.get_state())
    method.stack_step(xs, ys)
    resumed.stack_step(xs, ys)
    assert_close(resumed.state.mean, method.state.mean)
    assert_close(resumed.state.precision, method.state.precision)
    single = make_vogn(covariance="full")
    single.setup(logistic_problem())
    single.load_state_dict({"mean": saved["mean"][1], "precision": saved["precision"][1], "step": 1})
    assert_close(single.posterior().mean, saved["mean"][1])

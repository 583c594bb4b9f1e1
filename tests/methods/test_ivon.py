"""IVON (Shen et al. 2024, Algorithm 1): a step against a dense twin written from the algorithm, options, resume,
the posterior, and a fit that improves on its starting network."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from _runs import without_cost
from _toy import regression_data
from torch import Tensor, nn
from torch.testing import assert_close

from bdl_bench.checkpoint import load_checkpoint
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, prior_precision_vector
from bdl_bench.orchestration.runner import run
from bdl_bench.orchestration.sweep import run_job

OPTIONS = {
    "name": "ivon",
    "lr": 0.05,
    "beta1": 0.9,
    "beta2": 0.99,
    "hess_init": 0.5,
    "n_train_mc_samples": 3,
    "clip_radius": None,
    "decay": 0.0,
}
NOISE_PRECISION = 100.0  # the regression data below has noise std 0.1


def make_ivon(**overrides: object) -> Method:
    return build_method({**OPTIONS, **overrides})


def make_problem(seed: int, n_data: int = 100, hidden: int = 16, dtype: torch.dtype = torch.float32) -> Problem:
    torch.manual_seed(seed)
    model = build_model({"name": "mlp", "hidden": [hidden], "activation": "tanh"}, in_features=1, out_features=1)
    model = model.to(dtype)
    prior = prior_precision_vector(model, 1.0, 0.1)  # the biases' prior differs: delta is per parameter
    return Problem(
        model=model,
        likelihood=Gaussian(NOISE_PRECISION),
        n_data=n_data,
        prior_precision=prior,
        generator=torch.Generator().manual_seed(seed + 100),
    )


# --- one step against Algorithm 1, written out densely ---------------------------------------------------------


def dense_mlp_nll(theta: Tensor, x: Tensor, y: Tensor, hidden: int, tau: float) -> Tensor:
    """Mean Gaussian NLL of the 1-``hidden``-1 tanh MLP whose flat parameters are ``theta`` (weight then bias per
    layer, row-major), one example at a time."""
    w1 = theta[:hidden].view(hidden, 1)
    b1 = theta[hidden : 2 * hidden]
    w2 = theta[2 * hidden : 3 * hidden].view(1, hidden)
    b2 = theta[3 * hidden]
    total = theta.new_zeros(())
    for i in range(x.shape[0]):
        a = torch.tanh(w1[:, 0] * x[i, 0] + b1)
        f = (w2[0] * a).sum() + b2
        total = total + 0.5 * tau * (f - y[i]) ** 2 - 0.5 * math.log(tau / (2 * math.pi))
    return total / x.shape[0]


class DenseIVON:
    """Algorithm 1 of Shen et al. (2024), coordinate by coordinate, with lambda = N and delta = prior / N."""

    def __init__(self, m: Tensor, prior: Tensor, n_data: int, options: dict) -> None:
        self.m, self.prior, self.n, self.o = m.clone(), prior.clone(), n_data, options
        self.h = [options["hess_init"]] * m.numel()
        self.g = [0.0] * m.numel()
        self.t = 0

    def sigma(self) -> list[float]:
        delta = [float(p) / self.n for p in self.prior]
        return [1 / math.sqrt(self.n * (h + d)) for h, d in zip(self.h, delta)]

    def step(self, x: Tensor, y: Tensor, eps: Tensor, hidden: int, tau: float) -> tuple[float, float]:
        o, dim = self.o, self.m.numel()
        sigma = self.sigma()
        delta = [float(p) / self.n for p in self.prior]
        g_hat, h_hat, nlls = [0.0] * dim, [0.0] * dim, []
        for s in range(eps.shape[0]):
            theta = torch.tensor([float(self.m[d]) + sigma[d] * float(eps[s, d]) for d in range(dim)], dtype=x.dtype)
            theta.requires_grad_(True)
            nll = dense_mlp_nll(theta, x, y, hidden, tau)
            (grad,) = torch.autograd.grad(nll, theta)
            nlls.append(float(nll.detach()))
            for d in range(dim):
                g_hat[d] += float(grad[d]) / eps.shape[0]
                h_hat[d] += (
                    float(grad[d]) * (float(theta.detach()[d]) - float(self.m[d])) / sigma[d] ** 2 / eps.shape[0]
                )
        kl = 0.0
        for d in range(dim):
            p, v, mu = float(self.prior[d]), sigma[d] ** 2, float(self.m[d])
            kl += 0.5 * (p * v + p * mu**2 - 1 - math.log(p * v))
        self.t += 1
        rate = o["lr"] / (1 + self.t ** o["decay"]) if o["decay"] > 0 else o["lr"]
        new_m = []
        for d in range(dim):
            self.g[d] = o["beta1"] * self.g[d] + (1 - o["beta1"]) * g_hat[d]
            h = self.h[d]
            self.h[d] = (
                o["beta2"] * h
                + (1 - o["beta2"]) * h_hat[d]
                + 0.5 * (1 - o["beta2"]) ** 2 * (h - h_hat[d]) ** 2 / (h + delta[d])
            )
            g_bar = self.g[d] / (1 - o["beta1"] ** self.t)
            update = (g_bar + delta[d] * float(self.m[d])) / (self.h[d] + delta[d])
            if o["clip_radius"] is not None:
                update = min(max(update, -o["clip_radius"]), o["clip_radius"])
            new_m.append(float(self.m[d]) - rate * update)
        self.m = torch.tensor(new_m, dtype=self.m.dtype)
        return sum(nlls) / len(nlls), kl / self.n


@pytest.mark.parametrize(
    "overrides",
    [{}, {"clip_radius": 0.02, "decay": 0.51, "beta1": 0.0, "n_train_mc_samples": 1}],
    ids=["plain", "clipped-decayed"],
)
def test_steps_equal_a_dense_algorithm_1(overrides: dict) -> None:
    hidden = 3
    options = {**OPTIONS, **overrides}
    problem = make_problem(0, n_data=50, hidden=hidden, dtype=torch.float64)
    method = make_ivon(**overrides)
    method.setup(problem)
    dense = DenseIVON(flat_params(problem.model), problem.prior_precision, 50, options)
    noise = torch.Generator().manual_seed(problem.generator.initial_seed())  # the method's draws, replayed
    x, y, _, _ = regression_data(0, torch.float64)
    largest_moves = []
    for step in range(4):
        xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
        before = method.mean[0].clone()
        eps = torch.randn(options["n_train_mc_samples"], dense.m.numel(), generator=noise, dtype=torch.float64)
        nll, kl = dense.step(xb, yb, eps, hidden, NOISE_PRECISION)
        out = method.train_step(xb, yb)
        assert float(out["nll"]) == pytest.approx(nll, rel=1e-10)
        assert float(out["kl"]) == pytest.approx(kl, rel=1e-10)
        assert float(out["loss"]) == pytest.approx(nll + kl, rel=1e-10)
        assert_close(method.mean[0], dense.m, rtol=1e-9, atol=1e-12)
        assert_close(method.hess[0], torch.tensor(dense.h, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        assert_close(method.momentum[0], torch.tensor(dense.g, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        rate = options["lr"] / (1 + (step + 1) ** options["decay"]) if options["decay"] else options["lr"]
        largest_moves.append(float((method.mean[0] - before).abs().max()) / rate)
    assert (method.mean[0] - flat_params(problem.model)).abs().max() > 1e-3  # the steps moved the mean
    if options["clip_radius"] is not None:  # the clip was active: the largest move was exactly rate * radius
        assert largest_moves == pytest.approx([options["clip_radius"]] * 4, rel=1e-9)
    else:
        assert max(largest_moves) > 0.1  # (so the clipped case's radius 0.02 binds)


@pytest.mark.parametrize("beta2", [0.0, 0.9, 0.99999])
def test_the_hessian_estimate_stays_positive_under_negative_curvature_estimates(beta2: float) -> None:
    """h + delta > 0 after an update whose h-hat is far below zero, where the plain average
    beta2 h + (1 - beta2) h-hat is negative: the Riemannian correction's guarantee, at every beta2."""
    problem = make_problem(1, dtype=torch.float64)
    method = make_ivon(beta2=beta2, hess_init=1e-3)
    method.setup(problem)
    delta = method.prior / problem.n_data
    precision = method._precision()
    std = precision.rsqrt()
    eps = torch.randn(3, std.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = -1e4 * eps.sign().unsqueeze(0)  # h-hat = mean(grad * eps) / sigma: large and negative everywhere
    h_hat = (grads * eps).mean(1) / std
    plain = beta2 * method.hess + (1 - beta2) * h_hat
    assert bool((plain + delta < 0).all())
    before = method.hess + delta
    method._update(grads, eps, std, precision)
    after = method.hess + delta
    assert bool((after > 0).all())
    assert bool((after >= before / 2).all())  # a (1/2 (1 - cu)^2 + 1/2) >= a / 2


# --- options ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("lr", 0.0, "method.lr=0.0 is out of range: it must be a number > 0"),
        ("beta1", 1.0, r"method.beta1=1.0 is out of range: it must be a number in \[0, 1\)"),
        ("beta2", -0.1, r"method.beta2=-0.1 is out of range: it must be a number in \[0, 1\)"),
        ("hess_init", 0, "method.hess_init=0 is out of range: it must be a number > 0"),
        ("n_train_mc_samples", 0, "method.n_train_mc_samples=0 is out of range: it must be an integer >= 1"),
        ("n_train_mc_samples", 1.5, "method.n_train_mc_samples=1.5 is out of range: it must be an integer >= 1"),
        ("clip_radius", 0.0, "method.clip_radius=0.0 is out of range: it must be a number > 0 or null"),
        ("decay", -1, "method.decay=-1 is out of range: it must be a number >= 0"),
        ("lr", "fast", "method.lr='fast' is not a number: it must be a number > 0"),
    ],
)
def test_bad_options_give_one_line_errors(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^ivon: {message}$") as error:
        make_ivon(**{option: value})
    assert "\n" not in str(error.value)


def test_a_bad_option_on_the_command_line_is_one_line(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bdl_bench.orchestration.cli",
            "run",
            "method=ivon",
            "method.beta2=1.0",
            f"results_root={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "bdl-bench: method.beta2=1.0 is out of range: it must be a number in [0, 1)"


def test_refuses_a_model_with_dropout() -> None:
    problem = make_problem(0)
    model = build_model(
        {"name": "mlp", "hidden": [8], "activation": "relu", "dropout": 0.1}, in_features=1, out_features=1
    )
    problem = Problem(model, problem.likelihood, 100, prior_precision_vector(model, 1.0, None), problem.generator)
    with pytest.raises(ConfigError, match="dropout"):
        make_ivon().setup(problem)


# --- the fit ---------------------------------------------------------------------------------------------------


def test_fit_improves_the_test_likelihood_of_the_initial_network() -> None:
    x, y, x_test, y_test = regression_data(0)
    problem = make_problem(1)
    likelihood = problem.likelihood
    with torch.no_grad():
        initial_ll = float(-likelihood.nll(problem.model(x_test), y_test).mean())
        mean_ll = float(-Gaussian(1 / float(y.var())).nll(y.mean().expand(100, 1), y_test).mean())
    method = make_ivon()
    method.setup(problem)
    method.fit(x, y, n_epochs=150, batch_size=20, data_generator=torch.Generator().manual_seed(7))
    f = method.predict(x_test, 32)
    assert f.shape == (32, 100, 1)
    test_ll = float(likelihood.log_predictive(f, y_test).mean())
    rmse = float((f.mean(0).squeeze(-1) - y_test).square().mean().sqrt())
    assert test_ll > initial_ll + 10  # the initial network's LL under tau = 100 is far below zero
    assert test_ll > mean_ll  # and the fit beats the training mean's Gaussian
    assert rmse < 0.2  # noise std 0.1; the training mean's rmse is about 0.7
    # the posterior: mean m, precision N h + prior; its KL to the prior is the closed form the step reports
    q = method.posterior()
    assert isinstance(q, DiagGaussian)
    assert_close(q.mean, method.mean[0])
    assert_close(q.prec_diag, 100 * method.hess[0] + problem.prior_precision)
    prior = DiagGaussian(torch.zeros_like(q.mean), problem.prior_precision)
    from bdl_bench.gaussians import kl

    assert float(method.kl_to_prior()) == pytest.approx(float(kl(q, prior)), rel=1e-4)
    # predictive samples are whole networks drawn from q: their spread across samples is the posterior's
    assert float(f.std(0).mean()) > 0


def test_randomness_comes_from_the_generator() -> None:
    x, y, _, _ = regression_data(0)
    results = []
    for seed in (1, 1, 2):
        problem = make_problem(0)
        problem.generator.manual_seed(seed)
        torch.manual_seed(seed + 50)  # the global RNG must not matter
        method = make_ivon()
        method.setup(problem)
        method.train_step(x[:20], y[:20])
        results.append(method.mean.clone())
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


# --- checkpoints -----------------------------------------------------------------------------------------------


class Crash(Exception):
    """Stands for the process dying after an epoch."""


def test_a_run_killed_after_epoch_3_resumes_to_the_unbroken_metrics(tmp_path, compose_cfg, at_epoch_end) -> None:
    """Through the runner (checkpoint every 2 epochs, killed after 3): every metric and the posterior equal the
    unbroken run's, bit for bit."""

    def crash(done: int) -> None:
        if done == 3:
            raise Crash

    cfg = compose_cfg(["method=ivon", "trainer.n_epochs=5", "trainer.checkpoint_every=2"])
    unbroken = run(cfg, tmp_path / "unbroken").metrics
    killed = tmp_path / "killed"
    with at_epoch_end(crash), pytest.raises(Crash):
        run_job(cfg, killed)
    checkpoint = load_checkpoint(killed / "checkpoint.pt")
    assert checkpoint is not None and checkpoint.epoch == 2 and checkpoint.method["step"] > 0
    run_job(cfg, killed)
    assert without_cost(json.loads((killed / "metrics.json").read_text())) == without_cost(unbroken)
    for name in ("posterior.pt", "params.pt"):
        a = torch.load(tmp_path / "unbroken" / name, weights_only=False)
        b = torch.load(killed / name, weights_only=False)
        for x, y in zip(_tensors(a), _tensors(b)):
            assert torch.equal(x, y)


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [t for v in vars(value).values() for t in _tensors(v)] if hasattr(value, "__dict__") else []


def test_state_dict_is_a_copy_and_resumes_the_next_step() -> None:
    x, y, _, _ = regression_data(0)
    a = make_ivon()
    a.setup(make_problem(1))
    a.fit(x, y, n_epochs=2, batch_size=25, data_generator=torch.Generator().manual_seed(7))
    snapshot = a.state_dict()
    b = make_ivon()
    b.setup(make_problem(2))  # another start: everything that matters comes from the snapshot
    b.load_state_dict(snapshot)
    for method in (a, b):
        method.problem.generator.manual_seed(5)
        method.train_step(x[:25], y[:25])
    for key in ("mean", "hess", "momentum"):
        assert torch.equal(getattr(a, key), getattr(b, key))
        assert not torch.equal(getattr(a, key), snapshot[key])  # stepping a did not change the snapshot
    assert a.step == b.step == snapshot["step"] + 1


def test_a_stack_cannot_be_evaluated_as_one_copy() -> None:
    problems = [make_problem(0), make_problem(0)]
    method = make_ivon()
    method.setup_stack(problems)
    with pytest.raises(RuntimeError, match="copy_at"):
        method.posterior()
    copy = method.copy_at(1)
    assert copy.mean.shape == (1, method.mean.shape[1]) and isinstance(copy.posterior(), DiagGaussian)
    assert isinstance(problems[0].model, nn.Module)

r"""Exact Gaussian VI for Bayesian logistic regression by L-BFGS (``method=exact_vi``).

The "Full-Gaussian Exact" and "MF Exact" columns of SLANG Table 1 (Mishkin et al., 2018, Sec. 4.1):
maximise the ELBO, eq. (1),

.. math::

    \mathcal L(\mu, \Sigma) = \sum_{i=1}^N \mathbb E_{\mathcal N(f;\, s_i\tilde x_i^\top\mu,\;
    \tilde x_i^\top\Sigma\tilde x_i)}[\log\sigma(f)]
    \;-\; \mathrm{KL}\big(\mathcal N(\mu,\Sigma)\,\|\,\mathcal N(0, \operatorname{diag}(\lambda)^{-1})\big),

for :math:`y_i \in \{0,1\}`, :math:`s_i = 2y_i - 1`, :math:`\tilde x_i = [x_i, 1]` when the linear
layer has a bias (the flat parameter order is weight then bias, so the bias is the last
coordinate), with the closed form

.. math::

    \mathrm{KL} = \tfrac12\Big[\sum_j \lambda_j\Sigma_{jj} + \sum_j\lambda_j\mu_j^2 - D
        - \sum_j\log\lambda_j - \log|\Sigma|\Big].

The one-dimensional expectations are computed by ``bdl_bench.quadrature``: Gauss–Hermite /
Gauss–Laguerre quadrature (``expectation: quadrature``, ``n_quadrature`` nodes, ~1e-9 accurate) or
a Marlin et al. (2011)-style piecewise quadratic bound (``expectation: piecewise``, a lower bound
within 1.5e-4 per example, which is what the SLANG authors' MATLAB code optimises).

The variables are :math:`\mu` and :math:`\Sigma = AA^\top`: for ``covariance: full`` A is lower
triangular with a positive diagonal (optimised as its strictly-lower part and the log of its
diagonal), for ``covariance: diag`` A = diag(exp(log-std)). L-BFGS (``torch.optim.LBFGS``, strong
Wolfe line search, history 50) minimises :math:`-\mathcal L/N` on the whole training set in
float64, starting from the model's current parameters as the mean and
:math:`\Sigma_0 = \operatorname{diag}\big(1/(\lambda_j + \tfrac14\sum_i\tilde x_{ij}^2)\big)`, the
inverse diagonal of the log-joint's Hessian at θ = 0. It stops when the largest gradient entry is
at most ``tolerance``, when an iteration changes the objective or every variable by less than
``tolerance * 1e-3``, or after ``max_iter`` iterations. Not a minibatch method: ``fit`` ignores
``batch_size`` and ``n_epochs`` and reports once, at epoch ``n_epochs``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, FullGaussian
from bdl_bench.likelihoods import Bernoulli, Likelihood
from bdl_bench.methods._shared import Covariance, parse_choice
from bdl_bench.methods.base import NonFiniteLossError, PostHocMethod, Problem, register_method
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.quadrature import Expectation, expected_log_sigmoid_with
from bdl_bench.ranges import COUNT, POSITIVE, Range

_HISTORY_SIZE = 50


def check_logistic_regression(model: nn.Module, likelihood: Likelihood | None = None) -> nn.Linear:
    """The model's single ``nn.Linear`` layer with one output (alone or inside containers), after checking it is
    Bayesian logistic regression (and, when given, that the likelihood is ``Bernoulli``)."""
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    if len(leaves) != 1 or not isinstance(leaves[0], nn.Linear) or leaves[0].out_features != 1:
        found = ", ".join(type(m).__name__ for m in leaves) or "no layers"
        raise ConfigError(
            "exact_vi needs Bayesian logistic regression: a model that is a single nn.Linear layer "
            f"with one output (model=logreg) and a binary dataset; got layers [{found}]"
        )
    if likelihood is not None and not isinstance(likelihood, Bernoulli):
        raise ConfigError(f"exact_vi needs a Bernoulli likelihood (a binary dataset), got {type(likelihood).__name__}")
    return leaves[0]


def logistic_design(model: nn.Module, x: Tensor) -> Tensor:
    """The design matrix in flat-parameter coordinates: ``[x, 1]`` with a bias, else ``x``; ``(N, D)``."""
    layer = check_logistic_regression(model)
    if layer.bias is None:
        return x
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


def logistic_elbo_from_scale(
    mean: Tensor,
    scale: Tensor,
    x: Tensor,
    y: Tensor,
    prior_precision: Tensor,
    *,
    expectation: Expectation | str = Expectation.QUADRATURE,
    n_points: int = 32,
) -> Tensor:
    r"""ELBO per training example of logistic regression,
    :math:`\big(\sum_i \mathbb E_q[\log\sigma(s_i x_i^\top\theta)] - \mathrm{KL}(q\,\|\,
    \mathcal N(0, \operatorname{diag}(\lambda)^{-1}))\big)/N`, for :math:`q = \mathcal N(\mu, AA^\top)` given by
    ``mean`` and ``scale`` A: lower triangular ``(D, D)`` (entries above the diagonal ignored), or the standard
    deviations ``(D,)`` of a diagonal Σ; ``x`` the design matrix ``(N, D)`` (:func:`logistic_design`), ``y``
    labels in {0, 1}. The objective ``exact_vi`` optimises: :math:`x_i^\top\Sigma x_i = \|A^\top x_i\|^2`,
    :math:`\Sigma_{jj} = \sum_k A_{jk}^2`, :math:`\log|\Sigma| = 2\sum_j\log|A_{jj}|`.
    """
    if scale.ndim == 2:
        scale = torch.tril(scale)
        var_f = (x @ scale).square().sum(1)
    else:
        var_f = x.square() @ scale.square()
    mean_f = x @ mean
    signed = (2.0 * y.to(mean_f) - 1.0) * mean_f  # s_i x_i^T mu: log p(y | f) = log sigmoid(s f)
    ell = expected_log_sigmoid_with(signed, var_f, expectation=expectation, n_points=n_points)
    return (ell.sum() - _kl_from_scale(mean, scale, prior_precision.to(mean))) / x.shape[0]


def _kl_from_scale(mean: Tensor, scale: Tensor, lam: Tensor) -> Tensor:
    r"""KL(N(μ, AAᵀ) ‖ N(0, diag(λ)⁻¹)) for lower-triangular ``(D, D)`` or diagonal ``(D,)`` A (module docstring)."""
    if scale.ndim == 2:
        var_theta, diag = scale.square().sum(1), scale.diagonal()
    else:
        var_theta, diag = scale.square(), scale
    logdet_cov = 2.0 * diag.abs().log().sum()
    return 0.5 * ((lam * var_theta).sum() + (lam * mean * mean).sum() - mean.numel() - lam.log().sum() - logdet_cov)


@dataclass(frozen=True)
class ExactVIState:
    """The fitted Gaussian."""

    mean: Tensor  # (D,)
    scale: Tensor  # A with Σ = A Aᵀ: lower triangular (D, D), or standard deviations (D,)
    n_iter: int  # L-BFGS iterations made


@register_method("exact_vi")
class ExactVI(PostHocMethod):
    """Deterministic ELBO maximisation for Bayesian logistic regression (module docstring)."""

    option_ranges = MappingProxyType({"n_quadrature": Range(2, integer=True), "max_iter": COUNT, "tolerance": POSITIVE})
    trains_map = False  # the whole fit is fit_posterior's L-BFGS

    def __init__(
        self, *, covariance: str, expectation: str, n_quadrature: int, max_iter: int, tolerance: float
    ) -> None:
        self.covariance = parse_choice(Covariance, covariance, "covariance", "exact_vi")
        self.expectation = parse_choice(Expectation, expectation, "expectation", "exact_vi")
        self.keep_options(locals())

    @property
    def _full(self) -> bool:
        return self.covariance is Covariance.FULL

    def setup(self, problem: Problem) -> None:
        check_logistic_regression(problem.model, problem.likelihood)
        super().setup(problem)
        mean = flat_params(problem.model)
        std = problem.prior_precision.to(mean).rsqrt()
        self.state = ExactVIState(mean=mean, scale=torch.diag(std) if self._full else std, n_iter=0)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        raise NotImplementedError("exact_vi optimises the whole training set with L-BFGS: call fit, not train_step")

    def _scale(self, raw: Tensor) -> Tensor:
        """A from the unconstrained variables: strictly-lower part and log-diagonal, or log-std."""
        return torch.tril(raw, -1) + torch.diag(raw.diagonal().exp()) if self._full else raw.exp()

    @property
    def posterior_fitted(self) -> bool:
        return self.state.n_iter > 0

    def fit_posterior(self, x: Tensor, y: Tensor) -> dict[str, float]:
        """Run L-BFGS on the full training set from the current state; returns ``train/elbo`` (per example),
        ``train/loss`` (−ELBO/N), ``train/nll`` (expected NLL per example), ``train/n_iter`` and ``train/grad_max``.
        """
        like = self.state.mean
        f64 = torch.float64
        design = logistic_design(self.problem.model, x).to(f64)
        labels = y.to(f64)
        lam = self.problem.prior_precision.to(device=design.device, dtype=f64)
        mean = self.state.mean.detach().to(f64).clone().requires_grad_(True)
        if self.state.n_iter == 0:  # Σ₀ = diag(1 / (λ + ¼ Σ_i x̃_ij²)), see module docstring
            init_std = (lam + 0.25 * design.square().sum(0)).rsqrt()
            scale = torch.diag(init_std) if self._full else init_std
        else:
            scale = self.state.scale.detach().to(f64)
        if self._full:
            raw = (torch.tril(scale, -1) + torch.diag(scale.diagonal().log())).clone()
        else:
            raw = scale.log().clone()
        raw.requires_grad_(True)

        optimizer = torch.optim.LBFGS(
            [mean, raw],
            lr=1.0,
            max_iter=self.max_iter,
            max_eval=math.ceil(1.25 * self.max_iter),
            tolerance_grad=self.tolerance,
            tolerance_change=1e-3 * self.tolerance,
            history_size=_HISTORY_SIZE,
            line_search_fn="strong_wolfe",
        )

        def closure() -> Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = -logistic_elbo_from_scale(  # −ELBO/N at the unconstrained variables
                mean, self._scale(raw), design, labels, lam, expectation=self.expectation, n_points=self.n_quadrature
            )
            loss.backward()
            return loss

        optimizer.step(closure)
        n_iter = int(optimizer.state[mean].get("n_iter", 0))

        loss = closure().detach()
        grad_max = max(float(mean.grad.abs().max()), float(raw.grad.abs().max()))
        with torch.no_grad():
            final = self._scale(raw)
            if not (
                math.isfinite(float(loss)) and bool(torch.isfinite(mean).all()) and bool(torch.isfinite(final).all())
            ):
                raise NonFiniteLossError(
                    f"method 'exact_vi': non-finite ELBO or variables after {n_iter} L-BFGS iterations"
                )
            kl = _kl_from_scale(mean, final, lam)
        self.state = ExactVIState(
            mean=mean.detach().to(like), scale=final.detach().to(like), n_iter=self.state.n_iter + n_iter
        )
        return {
            "train/elbo": -float(loss),
            "train/loss": float(loss),
            "train/nll": float(loss) - float(kl) / design.shape[0],
            "train/n_iter": float(self.state.n_iter),
            "train/grad_max": grad_max,
        }

    def posterior(self) -> FullGaussian | DiagGaussian:
        s = self.state
        if self._full:
            scale64 = s.scale.to(torch.float64)
            precision = torch.cholesky_inverse(scale64)  # (A Aᵀ)⁻¹ for lower-triangular A
            precision = 0.5 * (precision + precision.T)
            return FullGaussian(s.mean, precision.to(s.mean))
        return DiagGaussian(s.mean, s.scale.square().reciprocal())

    def kl_to_prior(self) -> Tensor:
        q = self.posterior()
        return q.kl(DiagGaussian(torch.zeros_like(q.mean), self.problem.prior_precision.to(q.mean)))

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``(n_samples, N, 1)`` logits at θ_k = μ + A ε_k (generator: ``problem.generator``)."""
        s = self.state
        eps = torch.randn(
            (n_samples, s.mean.numel()), generator=self.problem.generator, dtype=s.mean.dtype, device=s.mean.device
        )
        thetas = s.mean + (eps @ s.scale.T if s.scale.ndim == 2 else eps * s.scale)
        return torch.stack([forward_with(self.problem.model, th, x) for th in thetas])

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {"mean": s.mean.clone(), "scale": s.scale.clone(), "n_iter": s.n_iter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mean, scale = state["mean"], state["scale"]
        if mean.shape != self.state.mean.shape or scale.shape != self.state.scale.shape:
            raise ValueError(
                f"exact_vi: checkpoint shapes mean {tuple(mean.shape)}, scale {tuple(scale.shape)} do not match "
                f"mean {tuple(self.state.mean.shape)}, scale {tuple(self.state.scale.shape)} (covariance={self.covariance.value})"
            )
        like = self.state.mean
        self.state = ExactVIState(mean=mean.to(like), scale=scale.to(like), n_iter=int(state["n_iter"]))

r"""Variational Online Gauss–Newton / Newton with a full or mean-field Gaussian (``method=vogn``).

The Table 1 baselines "Full-Gaussian EF / Hessian" and "Mean-Field EF / Hessian" of Mishkin et al.
(2018), SLANG, eq. (2) and Appendix A eqs. (12)–(13), after Khan et al. (2018). With
:math:`q_t = \mathcal N(\mu_t, S_t^{-1})`, prior :math:`\mathcal N(0, \operatorname{diag}(\lambda)^{-1})`,
N training examples, a minibatch :math:`\mathcal M` of M examples and K MC samples
:math:`\theta_{t,k} \sim q_t` (``n_train_mc_samples``), one step is

.. math::

    \hat g_t = \frac NM \sum_{i\in\mathcal M} \frac1K\sum_k g_i(\theta_{t,k}), \qquad
    \hat H_t = \frac NM \sum_{i\in\mathcal M} \frac1K\sum_k H_i(\theta_{t,k}),

    S_{t+1} = (1-\beta_t)\,S_t + \beta_t\,(\hat H_t + \operatorname{diag}\lambda), \qquad
    \mu_{t+1} = \mu_t - \alpha_t\, S_{t+1}^{-1}(\hat g_t + \lambda\odot\mu_t),

with :math:`g_i = \nabla_\theta[-\log p(y_i\mid x_i,\theta)]` and the per-example curvature
:math:`H_i` chosen by ``curvature``:

* ``ef`` — the empirical Fisher :math:`g_i g_i^\top` (SLANG eq. (2)).
* ``hessian`` — the generalised Gauss–Newton :math:`J_i^\top\Lambda_i J_i`, with
  :math:`J_i = \partial f(x_i,\theta)/\partial\theta` (out × D) and
  :math:`\Lambda_i = \partial^2[-\log p(y_i\mid f)]/\partial f^2` (out × out). For logistic
  regression (one linear layer) this *is* the exact Hessian
  :math:`\sigma(f_i)(1-\sigma(f_i))\,\tilde x_i\tilde x_i^\top`, :math:`\tilde x_i = [x_i, 1]`;
  for deeper models it drops the second-derivative-of-the-network term, which keeps it positive
  semi-definite for the Gaussian, Bernoulli and categorical likelihoods.

``covariance=diag`` keeps only the diagonals of :math:`\hat H_t` (so of :math:`S`), i.e. the
mean-field versions. Step t = 1, 2, … uses :math:`\alpha_t = \alpha/(1+t^{\text{decay}})` and
:math:`\beta_t = \beta/(1+t^{\text{decay}})` (``decay: 0`` keeps them constant): the schedule of the
SLANG authors' ``cvi.m``/``slang.m``, shared with ``method=slang`` (``decayed_rate``). The initial
mean is the model's current parameters; the initial precision is
:math:`S_0 = \operatorname{diag}(\lambda + \text{init\_prec})` (the authors start from
:math:`S_0 = I`, which is ``init_prec: 1`` up to λ). Like the authors' code, this is the update
with the exact :math:`\hat g_t, \hat H_t`; nothing is clipped or damped.

Computation: for ``nn.Sequential`` networks of ``nn.Linear`` layers (``logreg``, ``mlp``) all K·M
per-example gradients come from one batched forward/backward (``bdl_bench.curvature``: layer inputs
times output gradients). The GGN is a sum of such outer products too: writing
:math:`\Lambda_i = \sum_c a_{ic}a_{ic}^\top` (:func:`output_hessian_sqrt`),
:math:`J_i^\top\Lambda_iJ_i = \sum_c h_{ic}h_{ic}^\top` with :math:`h_{ic} = J_i^\top a_{ic}` the
gradient of the pseudo-loss :math:`a_{ic}^\top f_i` (``a`` held fixed), so ``out`` more passes give
it. Other models use ``torch.func`` (:func:`per_example_terms`: ``vmap(grad)``, ``jacrev``), one MC
sample at a time; that path is also the dense twin of the fast one in the tests. The full version
stores a D × D precision and refuses D > 5000.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev, vmap

from bdl_bench.curvature import LinearLayout, linear_factors, linear_layout, sq_diag
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, FullGaussian
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.methods._shared import parse_choice
from bdl_bench.methods.base import CannotStack, Method, NonFiniteLossError, Problem, register_method, stacked_prior
from bdl_bench.methods.slang import decayed_rate
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.ranges import COUNT, POSITIVE, Range

__all__ = [
    "MAX_FULL_PARAMS",
    "VOGN",
    "Covariance",
    "Curvature",
    "VognState",
    "factored_terms",
    "output_hessian",
    "output_hessian_sqrt",
    "parse_choice",
    "per_example_terms",
]

MAX_FULL_PARAMS = 5000
"""Largest D for ``covariance=full`` (a D x D precision and its Cholesky factor each step)."""


class Covariance(str, Enum):
    """Structure of the Gaussian posterior's precision."""

    FULL = "full"
    """Dense D x D precision ("Full-Gaussian" in SLANG Table 1)."""
    DIAG = "diag"
    """Diagonal precision ("Mean-Field" in SLANG Table 1)."""


class Curvature(str, Enum):
    """Per-example curvature in the precision update."""

    EF = "ef"
    """Empirical Fisher g_i g_iᵀ."""
    HESSIAN = "hessian"
    """Generalised Gauss–Newton J_iᵀ Λ_i J_i (the exact Hessian for logistic regression)."""


@dataclass(frozen=True)
class VognState:
    """What changes while fitting.

    Attributes:
        mean: μ_t, ``(D,)``.
        precision: S_t, ``(D, D)`` for ``covariance=full``, its diagonal ``(D,)`` for ``diag``.
        step: t, the number of updates made so far.
        chol: the lower Cholesky factor of a full S_t when known (the update that made S_t factored it
            for its mean step; the next step samples with it instead of factoring S_t again); ``None``
            for ``diag`` or when not known (it is recomputed, with the same result).
    """

    mean: Tensor  # (D,)
    precision: Tensor  # (D, D) or (D,)
    step: int
    chol: Tensor | None = None


def _cholesky(precision: Tensor, step: int) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(precision)
    if int(info.item()) != 0:
        raise NonFiniteLossError(
            f"method 'vogn': precision is not positive definite after step {step} "
            f"(leading minor {int(info.item())}) — lower beta or check the data"
        )
    return chol


def _kl_to_prior(state: VognState, chol: Tensor | None, prior_precision: Tensor, noise: Tensor | None = None) -> Tensor:
    r"""KL(N(μ, S⁻¹) ‖ N(0, diag(λ)⁻¹)) = ½[Σ_j λ_j Σ_jj + Σ_j λ_j μ_j² − D − Σ_j log λ_j + log|S|]; with a
    leading copy dimension on the state (stacked splits), one KL per copy.

    For a full S given ``noise`` (θ_k − μ of K samples of q, ``(..., K, D)``), the trace term
    Σ_j λ_j Σ_jj is estimated by their mean of (θ_k − μ)ᵀ diag(λ)(θ_k − μ) (unbiased; a training step's
    loss, as SLANG's) instead of from S⁻¹, whose D³/3 triangular solve cost as much as the rest of a
    stacked USPS step."""
    lam, mean = prior_precision, state.mean
    if chol is None:  # diagonal
        trace, logdet = (lam * state.precision.reciprocal()).sum(-1), state.precision.log().sum(-1)
    else:
        if noise is None:
            eye = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device).expand_as(chol)
            trace = (lam * torch.linalg.solve_triangular(chol, eye, upper=False).square().sum(-2)).sum(-1)
        else:
            trace = (noise.square() @ lam[..., None]).squeeze(-1).mean(-1)
        logdet = 2.0 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    quad = trace + (lam * mean * mean).sum(-1)
    return 0.5 * (quad - mean.shape[-1] - lam.log().sum(-1) + logdet)


def output_hessian(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r"""Λ_i = ∂²[−log p(y_i | f_i)]/∂f_i², ``(M, out, out)``, for outputs ``f`` ``(M, out)``.

    Closed forms for the built-in likelihoods — Bernoulli σ(f)σ(−f), Gaussian τ, categorical
    diag(p) − p pᵀ with p = softmax(f) — and ``vmap(hessian)`` of ``likelihood.nll`` otherwise.
    """
    if isinstance(likelihood, Bernoulli):
        return (torch.sigmoid(f) * torch.sigmoid(-f)).unsqueeze(-1)
    if isinstance(likelihood, Gaussian):
        return torch.full((f.shape[0], 1, 1), likelihood.noise_precision, dtype=f.dtype, device=f.device)
    if isinstance(likelihood, Categorical):
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def nll_one(f_i: Tensor, y_i: Tensor) -> Tensor:
        return likelihood.nll(f_i.unsqueeze(0), y_i.unsqueeze(0)).squeeze(0)

    return vmap(hessian(nll_one))(f, y)


def per_example_terms(
    model: nn.Module, likelihood: Likelihood, theta: Tensor, x: Tensor, y: Tensor, *, curvature: Curvature, full: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-example NLL ``(M,)``, gradients ``(M, D)`` and the curvature summed over the examples.

    The curvature is ``(D, D)`` when ``full``, else its diagonal ``(D,)``: Σ_i g_i g_iᵀ for ``ef``
    (per-example gradients by ``vmap(grad)``), Σ_i J_iᵀ Λ_i J_i for ``hessian``, with J = ∂f/∂θ
    from one ``jacrev`` of the batched forward pass (valid as no layer mixes examples) and Λ_i from
    :func:`output_hessian`. Gradients are of −log p(y_i | x_i, θ) at the flat parameters ``theta``.
    """
    curvature = Curvature(curvature)
    if curvature is Curvature.EF:

        def loss_one(th: Tensor, x_i: Tensor, y_i: Tensor) -> Tensor:
            return likelihood.nll(forward_with(model, th, x_i.unsqueeze(0)), y_i.unsqueeze(0)).squeeze(0)

        grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(theta, x, y)  # (M, D)
        nll = likelihood.nll(forward_with(model, theta, x), y)
        curv = grads.T @ grads if full else grads.square().sum(0)
        return nll, grads, curv

    def outputs(th: Tensor) -> tuple[Tensor, Tensor]:
        out = forward_with(model, th, x)
        return out, out

    jac, f = jacrev(outputs, has_aux=True)(theta)  # (M, out, D), (M, out)
    f = f.detach().requires_grad_(True)
    with torch.enable_grad():
        nll = likelihood.nll(f, y)
        (resid,) = torch.autograd.grad(nll.sum(), f)  # (M, out): ∂nll_i/∂f_i
    lam = output_hessian(likelihood, f.detach(), y)  # (M, out, out)
    grads = (resid.unsqueeze(1) @ jac).squeeze(1)  # (M, D): g_i = J_iᵀ r_i
    lam_jac = lam @ jac  # (M, out, D)
    if full:
        n_rows = jac.shape[0] * jac.shape[1]
        curv = jac.reshape(n_rows, -1).T @ lam_jac.reshape(n_rows, -1)  # Σ_i J_iᵀ Λ_i J_i
        curv = 0.5 * (curv + curv.T)
    else:
        curv = (jac * lam_jac).sum((0, 1))
    return nll.detach(), grads, curv


def output_hessian_sqrt(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    r"""Rows :math:`a_{ic}` with :math:`\Lambda_i = \sum_c a_{ic}a_{ic}^\top`: shape ``(M, C, out)``.

    Bernoulli :math:`\sqrt{\sigma(f)\sigma(-f)}`, Gaussian :math:`\sqrt\tau`, categorical
    :math:`a_{ic} = \sqrt{p_c}\,(e_c - p)` (since :math:`\sum_c p_c(e_c-p)(e_c-p)^\top =
    \operatorname{diag}(p) - pp^\top`); otherwise the eigendecomposition of :func:`output_hessian`
    (negative eigenvalues, possible for a non-convex likelihood, are set to 0).
    """
    if isinstance(likelihood, Bernoulli):
        return (torch.sigmoid(f) * torch.sigmoid(-f)).sqrt().unsqueeze(-1)
    if isinstance(likelihood, Gaussian):
        return torch.full((f.shape[0], 1, 1), likelihood.noise_precision**0.5, dtype=f.dtype, device=f.device)
    if isinstance(likelihood, Categorical):
        p = torch.softmax(f, dim=-1)  # (M, out)
        eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
        return p.sqrt().unsqueeze(-1) * (eye - p.unsqueeze(-2))
    evals, evecs = torch.linalg.eigh(output_hessian(likelihood, f, y))
    return (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)).mT


class _PseudoLoss(Likelihood):
    r""":math:`\ell_p = a_p^\top f_p` with fixed rows ``a`` ``(P, out)``: its gradients are :math:`J_p^\top a_p`."""

    def __init__(self, coeffs: Tensor) -> None:
        self.coeffs = coeffs

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return (f * self.coeffs).sum(-1)


def factored_terms(
    model: nn.Module,
    likelihood: Likelihood,
    thetas: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    curvature: Curvature,
    full: bool,
    layout: LinearLayout | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean NLL, Σ g and Σ H over K samples × M examples, from layer factors (module docstring).

    Args:
        model: an ``nn.Sequential`` of ``nn.Linear`` and parameter-free modules.
        thetas: ``(K, D)`` parameter samples.
        x, y: the minibatch.
        curvature, full: as in :func:`per_example_terms`.
        layout: ``linear_layout(model)``, to skip recomputing it.

    Returns:
        The NLL averaged over samples and examples (scalar), Σ_{k,i} g_{k,i} ``(D,)`` and
        Σ_{k,i} H_{k,i} ``(D, D)`` or its diagonal ``(D,)``.
    """
    curvature = Curvature(curvature)
    layout = linear_layout(model) if layout is None else layout
    factors = linear_factors(model, thetas, x, y, likelihood, layout)
    grad_sum = factors.grad_sum()
    if curvature is Curvature.EF:
        pieces = [factors]
    else:
        n_cols = factors.n_columns
        f = factors.outputs.reshape(n_cols, -1)
        roots = output_hessian_sqrt(likelihood, f, y.repeat(thetas.shape[0]))  # (P, C, out)
        pieces = [linear_factors(model, thetas, x, y, _PseudoLoss(roots[:, c]), layout) for c in range(roots.shape[1])]
    curv = torch.zeros((layout.n_params,) * (2 if full else 1), dtype=grad_sum.dtype, device=grad_sum.device)
    for piece in pieces:
        if full:
            columns = piece.dense()  # (D, P)
            curv.addmm_(columns, columns.mT)
        else:
            curv += sq_diag(piece)
    return factors.losses.mean(), grad_sum, curv


@register_method("vogn")
class VOGN(Method):
    """Natural-gradient VI with a full or diagonal Gaussian (module docstring). Splits can be stacked
    (:meth:`setup_replicas`) for networks of ``nn.Linear`` layers.

    Args:
        covariance: ``full`` or ``diag``.
        curvature: ``ef`` (empirical Fisher) or ``hessian`` (generalised Gauss–Newton).
        lr: α, the mean step size (> 0).
        beta: β, the precision step size, in (0, 1].
        decay: exponent of the schedule ``rate / (1 + t**decay)`` at step t = 1, 2, … (>= 0; 0 = constant).
        n_train_mc_samples: K, posterior samples per step (>= 1).
        init_prec: added to the prior precision for the initial precision S_0 (>= 0).

    Raises:
        ValueError: on a bad option, naming the value and the valid choices or range.
    """

    option_ranges = MappingProxyType(
        {
            "lr": POSITIVE,
            "beta": Range(0, 1, low_open=True),
            "decay": Range(0),
            "n_train_mc_samples": COUNT,
            "init_prec": Range(0),
        }
    )
    supports_replicas = True  # stacked splits: networks of nn.Linear layers (logistic regression, MLPs)

    def __init__(
        self,
        *,
        covariance: str,
        curvature: str,
        lr: float,
        beta: float,
        decay: float,
        n_train_mc_samples: int,
        init_prec: float,
    ) -> None:
        self.covariance = parse_choice(Covariance, covariance, "covariance", "vogn")
        self.curvature = parse_choice(Curvature, curvature, "curvature", "vogn")
        if not lr > 0:
            raise ConfigError(f"vogn: lr must be positive, got {lr}")
        if not 0 < beta <= 1:
            raise ConfigError(f"vogn: beta must be in (0, 1], got {beta}")
        if not decay >= 0:
            raise ConfigError(f"vogn: decay must be >= 0, got {decay}")
        if int(n_train_mc_samples) != n_train_mc_samples or n_train_mc_samples < 1:
            raise ConfigError(f"vogn: n_train_mc_samples must be a positive integer, got {n_train_mc_samples}")
        if not init_prec >= 0:
            raise ConfigError(f"vogn: init_prec must be >= 0, got {init_prec}")
        self.lr, self.beta, self.decay = float(lr), float(beta), float(decay)
        self.n_train_mc_samples = int(n_train_mc_samples)
        self.init_prec = float(init_prec)

    # ------------------------------------------------------------------------------ setup
    def setup(self, problem: Problem) -> None:
        super().setup(problem)
        mean = flat_params(problem.model)
        n = mean.numel()
        if problem.prior_precision.shape != (n,):
            raise ValueError(f"vogn: prior_precision has shape {tuple(problem.prior_precision.shape)}, expected ({n},)")
        if self.covariance is Covariance.FULL and n > MAX_FULL_PARAMS:
            raise ConfigError(
                f"vogn: covariance=full stores a D x D precision, but the model has D={n} parameters "
                f"(limit {MAX_FULL_PARAMS}); use covariance=diag or a low-rank method such as slang"
            )
        try:
            self._layout: LinearLayout | None = linear_layout(problem.model)
        except ValueError:
            self._layout = None  # not a Sequential of Linear layers: the torch.func path
        prec_diag = problem.prior_precision.to(mean) + self.init_prec
        precision = torch.diag(prec_diag) if self.covariance is Covariance.FULL else prec_diag
        self.state = VognState(mean=mean, precision=precision, step=0)

    @property
    def _full(self) -> bool:
        return self.covariance is Covariance.FULL

    # ---------------------------------------------------------------------------- helpers
    def _sampling_cholesky(self, state: VognState) -> Tensor | None:
        """The Cholesky factor of a full precision (the one the state carries, else computed); ``None`` for diag."""
        if not self._full:
            return None
        return state.chol if state.chol is not None else _cholesky(state.precision, state.step)

    def _sample(self, state: VognState, chol: Tensor | None, n_samples: int) -> Tensor:
        """θ_k = μ + A ε_k with A Aᵀ = S⁻¹ (A = L⁻ᵀ for S = L Lᵀ; A = S^{-1/2} for diagonal S): ``(K, D)``."""
        mean = state.mean
        eps = torch.randn(
            (n_samples, mean.numel()), generator=self.problem.generator, dtype=mean.dtype, device=mean.device
        )
        if chol is None:
            return mean + eps * state.precision.rsqrt()
        return mean + torch.linalg.solve_triangular(chol, eps, upper=False, left=False)

    # ----------------------------------------------------------------------------- update
    def update(self, state: VognState, x: Tensor, y: Tensor) -> tuple[VognState, dict[str, Tensor]]:
        """One natural-gradient step on the minibatch ``(x, y)`` (module docstring).

        Returns:
            The new state and ``{"loss", "nll"}`` (0-dim tensors): the minibatch estimate of −ELBO/N at the
            current q (expected NLL per example plus KL/N; for ``covariance=full`` the KL's trace term
            is estimated from the step's samples, :func:`_kl_to_prior`) and of the expected NLL per example.
            With a diagonal precision, a step whose new mean or precision would not be finite, or whose
            precision would not be positive, keeps the old ones and reports a NaN loss, found without
            reading the device (:meth:`Method.fit` raises at the end of the epoch).

        Raises:
            NonFiniteLossError: ``covariance=full``: if the new mean or precision is not finite, or the
                precision is not positive definite (its Cholesky reads the device anyway).
        """
        p = self.problem
        lam = p.prior_precision.to(state.mean)
        chol = self._sampling_cholesky(state)
        thetas = self._sample(state, chol, self.n_train_mc_samples)
        if self._layout is not None:
            nll_mean, g_sum, h_sum = factored_terms(
                p.model, p.likelihood, thetas, x, y, curvature=self.curvature, full=self._full, layout=self._layout
            )
        else:
            g_sum, h_sum = torch.zeros_like(state.mean), torch.zeros_like(state.precision)
            nll_mean = torch.zeros((), dtype=state.mean.dtype, device=state.mean.device)
            for theta in thetas:
                nll, grads, curv = per_example_terms(
                    p.model, p.likelihood, theta, x, y, curvature=self.curvature, full=self._full
                )
                nll_mean = nll_mean + nll.mean() / self.n_train_mc_samples
                g_sum += grads.sum(0)
                h_sum += curv
        nll_mean = nll_mean.detach().reshape(())
        scale = p.n_data / (x.shape[0] * self.n_train_mc_samples)
        g_hat, h_hat = scale * g_sum, scale * h_sum

        step = state.step + 1
        precision, alpha = self._precision_step(state.precision, h_hat, lam, step)
        direction = g_hat + lam * state.mean
        new_chol = None
        if self._full:
            if not (bool(torch.isfinite(precision).all()) and bool(torch.isfinite(g_hat).all())):
                raise NonFiniteLossError(f"method 'vogn': non-finite precision or gradient at step {step}")
            new_chol = _cholesky(precision, step)
            delta = torch.cholesky_solve(direction[:, None], new_chol)[:, 0]
            mean = state.mean - alpha * delta
            if not bool(torch.isfinite(mean).all()):
                raise NonFiniteLossError(f"method 'vogn': non-finite mean at step {step}")
            ok = None
        else:
            mean = state.mean - alpha * (direction / precision)
            ok = (precision > 0).all() & torch.isfinite(precision).all() & torch.isfinite(mean).all()
            mean, precision = torch.where(ok, mean, state.mean), torch.where(ok, precision, state.precision)

        kl = _kl_to_prior(state, chol, lam, noise=None if chol is None else thetas - state.mean).detach()
        loss = nll_mean + kl / p.n_data
        if ok is not None:
            loss = torch.where(ok, loss, torch.full_like(loss, math.nan))
        out = {"loss": loss, "nll": nll_mean}
        return VognState(mean=mean, precision=precision, step=step, chol=new_chol), out

    def _precision_step(self, precision: Tensor, h_hat: Tensor, lam: Tensor, step: int) -> tuple[Tensor, float]:
        """:math:`S_{t+1} = (1-\\beta_t)S_t + \\beta_t(\\hat H_t + \\operatorname{diag}\\lambda)` (symmetrised when
        full; stacked copies allowed) and the step's :math:`\\alpha_t`."""
        alpha = decayed_rate(self.lr, self.decay, step)
        beta = decayed_rate(self.beta, self.decay, step)
        if self._full:
            new = (1 - beta) * precision + beta * (h_hat + torch.diag_embed(lam))
            return 0.5 * (new + new.mT), alpha
        return (1 - beta) * precision + beta * (h_hat + lam), alpha

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        self.state, out = self.update(self.state, x, y)
        return out

    # ---------------------------------------------------------------------- stacked splits
    def setup_replicas(self, problems: Sequence[Problem]) -> None:
        """R copies of the initial state, stacked (mean ``(R, D)``, precision ``(R, D, D)`` or ``(R, D)``);
        fitted by :meth:`train_step_replicas` (:mod:`bdl_bench.methods._vogn_stacked`).

        Raises:
            CannotStack: for a model that is not a ``nn.Sequential`` of ``nn.Linear`` layers.
        """
        self.setup(problems[0])
        if self._layout is None:
            raise CannotStack("method 'vogn' stacks splits only for networks of nn.Linear layers (logreg, mlp)")
        self._replica_problems = list(problems)
        self._replica_prior = stacked_prior(problems).to(self.state.mean)  # (R, D): each copy its own
        n_copies, s = len(problems), self.state
        prec_diag = self._replica_prior + self.init_prec  # setup's initial precision, per copy
        self.state = VognState(
            mean=s.mean.expand(n_copies, *s.mean.shape).clone(),
            precision=torch.diag_embed(prec_diag) if self._full else prec_diag,
            step=0,
        )

    @torch.no_grad()
    def train_step_replicas(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """:meth:`update` of every copy on its minibatch (``x`` ``(R, M, in)``, ``y`` ``(R, M)``); the
        statistics as ``(R,)`` tensors.

        Raises:
            NonFiniteLossError: naming the copy and step, as :meth:`update` does for a single run.
        """
        from bdl_bench.methods import _vogn_stacked as stacked

        p, state = self.problem, self.state
        assert self._layout is not None and state.mean.dim() == 2, "setup_replicas first"
        lam = self._replica_prior
        n_copies, n_params = state.mean.shape
        n_samples = self.n_train_mc_samples
        chol = None
        if self._full:
            chol = state.chol if state.chol is not None else stacked.cholesky_or_raise(state.precision, state.step)
        eps = torch.randn(
            (n_samples, n_params), generator=p.generator, dtype=state.mean.dtype, device=state.mean.device
        )
        if chol is None:  # the draws of a single run of the same seed, shared by the copies
            noise = None
            thetas = state.mean[:, None] + eps * state.precision.rsqrt()[:, None]
        else:
            noise = torch.linalg.solve_triangular(chol, eps.expand(n_copies, -1, -1), upper=False, left=False)
            thetas = state.mean[:, None] + noise
        likelihoods = [q.likelihood for q in self._replica_problems]
        nll, g_sum, h_sum = stacked.stacked_terms(
            p.model,
            self._layout,
            likelihoods,
            thetas,
            x,
            y,
            hessian=self.curvature is Curvature.HESSIAN,
            full=self._full,
        )
        scale = p.n_data / (x.shape[1] * n_samples)
        g_hat, h_hat = scale * g_sum, scale * h_sum

        step = state.step + 1
        precision, alpha = self._precision_step(state.precision, h_hat, lam, step)
        direction = g_hat + lam * state.mean
        new_chol, ok = None, None
        if self._full:
            bad = stacked.first_bad_copy(precision, g_hat)
            if bad is not None:
                raise NonFiniteLossError(
                    f"method 'vogn': non-finite precision or gradient in stacked copy {bad} at step {step}"
                )
            new_chol = stacked.cholesky_or_raise(precision, step)
            mean = state.mean - alpha * torch.cholesky_solve(direction[..., None], new_chol)[..., 0]
            bad = stacked.first_bad_copy(mean)
            if bad is not None:
                raise NonFiniteLossError(f"method 'vogn': non-finite mean in stacked copy {bad} at step {step}")
        else:  # as the single run's diagonal step: a bad copy keeps its state and reports NaN, unread
            mean = state.mean - alpha * (direction / precision)
            ok = (precision > 0).all(1) & torch.isfinite(precision).all(1) & torch.isfinite(mean).all(1)  # (R,)
            mean = torch.where(ok[:, None], mean, state.mean)
            precision = torch.where(ok[:, None], precision, state.precision)
        kl = _kl_to_prior(state, chol, lam, noise)
        self.state = VognState(mean=mean, precision=precision, step=step, chol=new_chol)
        loss = nll + kl / p.n_data
        if ok is not None:
            loss = torch.where(ok, loss, torch.full_like(loss, math.nan))
        return {"loss": loss, "nll": nll}

    def replica(self, index: int) -> VOGN:
        single = copy.copy(self)
        single.setup(self._replica_problems[index])
        s = self.state
        single.state = VognState(
            mean=s.mean[index].clone(),
            precision=s.precision[index].clone(),
            step=s.step,
            chol=None if s.chol is None else s.chol[index].clone(),
        )
        return single

    # -------------------------------------------------------------------------- posterior
    def posterior(self) -> FullGaussian | DiagGaussian:
        s = self.state
        if self._full:
            return FullGaussian(s.mean, s.precision)
        return DiagGaussian(s.mean, s.precision)

    def kl_to_prior(self) -> Tensor:
        q = self.posterior()
        prior = DiagGaussian(torch.zeros_like(q.mean), self.problem.prior_precision.to(q.mean))
        return q.kl(prior)

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``(n_samples, N, out)`` network outputs at θ_k ~ q (generator: ``problem.generator``)."""
        thetas = self._sample(self.state, self._sampling_cholesky(self.state), n_samples)
        return torch.stack([forward_with(self.problem.model, th, x) for th in thetas])

    # ------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {"mean": s.mean.clone(), "precision": s.precision.clone(), "step": s.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mean, precision = state["mean"], state["precision"]
        if mean.shape != self.state.mean.shape or precision.shape != self.state.precision.shape:
            raise ValueError(
                f"vogn: checkpoint shapes mean {tuple(mean.shape)}, precision {tuple(precision.shape)} "
                f"do not match mean {tuple(self.state.mean.shape)}, precision {tuple(self.state.precision.shape)} "
                f"(covariance={self.covariance.value})"
            )
        if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(precision).all())):
            raise ValueError("vogn: checkpoint holds a non-finite mean or precision")
        like = self.state.mean
        self.state = VognState(mean=mean.to(like), precision=precision.to(like), step=int(state["step"]))

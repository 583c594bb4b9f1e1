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

``covariance=diag`` keeps only the diagonals of :math:`\hat H_t` (so of :math:`S`): the mean-field versions.
Step t = 1, 2, … uses :math:`\alpha_t = \alpha/(1+t^{\text{decay}})` and :math:`\beta_t = \beta/(1+t^{\text{decay}})`,
the schedule of the SLANG authors' ``cvi.m``/``slang.m``. The initial mean is the model's parameters, the
initial precision :math:`S_0 = \operatorname{diag}(\lambda + \text{init\_prec})` (the authors' :math:`S_0 = I`
is ``init_prec: 1`` up to λ). As in the authors' code, nothing is clipped or damped.

Computation, for R stacked copies (mean ``(R, D)``, precision ``(R, D, D)`` or ``(R, D)``; one ``(K, D)`` draw
shared by the copies): for ``nn.Sequential`` networks of ``nn.Linear`` layers all K·M per-example gradients of
every copy come from one batched forward/backward (:mod:`bdl_bench.curvature.stacked`). The GGN is a sum of
such outer products too: with :math:`\Lambda_i = \sum_c a_{ic}a_{ic}^\top`
(:meth:`~bdl_bench.likelihoods.Likelihood.hessian_sqrt`), :math:`J_i^\top\Lambda_iJ_i = \sum_c h_{ic}h_{ic}^\top`
where :math:`h_{ic} = J_i^\top a_{ic}` is the gradient of the pseudo-loss :math:`a_{ic}^\top f_i` (``a`` held
fixed). Other models use ``torch.func`` (:func:`per_example_terms`), one MC sample at a time and a single run
only. The full version stores a D × D precision and refuses D > 5000.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import grad, jacrev, vmap

from bdl_bench.curvature.per_example import LinearLayout, linear_layout
from bdl_bench.curvature.stacked import gradient_sum, gram, squared_gradient_sum, stacked_factors
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, FullGaussian
from bdl_bench.likelihoods import Likelihood
from bdl_bench.methods._shared import Covariance, decayed_rate, parse_choice
from bdl_bench.methods.base import (
    CannotStack,
    NonFiniteLossError,
    Problem,
    StackedMethod,
    register_method,
)
from bdl_bench.models.params import forward_with, n_params
from bdl_bench.ranges import COUNT, POSITIVE, Range

MAX_FULL_PARAMS = 5000
"""Largest D for ``covariance=full`` (a D x D precision and its Cholesky factor each step)."""


class Curvature(str, Enum):
    """Per-example curvature in the precision update (module docstring)."""

    EF = "ef"
    HESSIAN = "hessian"


@dataclass(frozen=True)
class VognState:
    """What changes while fitting, for R stacked copies. ``chol``: the lower Cholesky factors of a full S_t
    when the update that made S_t factored it (the next step samples with them), else ``None``."""

    mean: Tensor  # (R, D)  mu_t
    precision: Tensor  # (R, D, D) or its diagonal (R, D)  S_t
    step: int  # t, updates made so far
    chol: Tensor | None = None


def _in_copy(index: int, n_copies: int) -> str:
    return f" in stacked copy {index}" if n_copies > 1 else ""


def _cholesky(precision: Tensor, step: int) -> Tensor:
    """Lower Cholesky factors of ``(R, D, D)`` precisions; :class:`NonFiniteLossError` if one is not positive
    definite."""
    chol, info = torch.linalg.cholesky_ex(precision)
    if bool(info.any()):
        bad = int(info.flatten().nonzero()[0, 0])
        which = f" of stacked copy {bad}" if info.numel() > 1 else ""
        raise NonFiniteLossError(
            f"method 'vogn': precision{which} is not positive definite after step {step} "
            f"(leading minor {int(info.flatten()[bad])}) — lower beta or check the data"
        )
    return chol


def _first_bad_copy(*tensors: Tensor) -> int | None:
    """The first copy (leading index) where any of ``tensors`` is not finite, or ``None`` (one device read)."""
    ok = torch.isfinite(tensors[0]).all()
    for t in tensors[1:]:
        ok &= torch.isfinite(t).all()
    if bool(ok):
        return None
    finite = torch.stack([torch.isfinite(t).flatten(1).all(1) for t in tensors]).all(0)
    return int((~finite).nonzero()[0, 0])


def _kl_to_prior(state: VognState, chol: Tensor | None, prior_precision: Tensor, noise: Tensor) -> Tensor:
    r"""KL(N(μ, S⁻¹) ‖ N(0, diag(λ)⁻¹)) = ½[Σ_j λ_j Σ_jj + Σ_j λ_j μ_j² − D − Σ_j log λ_j + log|S|], one per copy
    of the state's leading copy dimension.

    For a full S (``chol`` its Cholesky factors) the trace term Σ_j λ_j Σ_jj is estimated from ``noise``
    (θ_k − μ of K samples of q, ``(..., K, D)``) by their mean of (θ_k − μ)ᵀ diag(λ)(θ_k − μ) (unbiased; a
    training step's loss, as SLANG's), sparing the D³/3 triangular solve for S⁻¹."""
    lam, mean = prior_precision, state.mean
    if chol is None:  # diagonal
        trace, logdet = (lam * state.precision.reciprocal()).sum(-1), state.precision.log().sum(-1)
    else:
        trace = (noise.square() @ lam[..., None]).squeeze(-1).mean(-1)
        logdet = 2.0 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    quad = trace + (lam * mean * mean).sum(-1)
    return 0.5 * (quad - mean.shape[-1] - lam.log().sum(-1) + logdet)


def per_example_terms(
    model: nn.Module, likelihood: Likelihood, theta: Tensor, x: Tensor, y: Tensor, *, curvature: Curvature, full: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-example NLL ``(M,)``, gradients ``(M, D)`` and the curvature summed over the examples.

    The curvature is ``(D, D)`` when ``full``, else its diagonal ``(D,)``: Σ_i g_i g_iᵀ for ``ef``
    (per-example gradients by ``vmap(grad)``), Σ_i J_iᵀ Λ_i J_i for ``hessian``, with J = ∂f/∂θ
    from one ``jacrev`` of the batched forward pass (valid as no layer mixes examples) and
    Λ_i = Σ_c a_ic a_icᵀ from :meth:`~bdl_bench.likelihoods.Likelihood.hessian_sqrt`. Gradients are of
    −log p(y_i | x_i, θ) at the flat parameters ``theta``.
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
    grads = (resid.unsqueeze(1) @ jac).squeeze(1)  # (M, D): g_i = J_iᵀ r_i
    roots = likelihood.hessian_sqrt(f.detach(), y)  # (C, M, out)
    pseudo = torch.einsum("cmo,mod->cmd", roots, jac)  # (C, M, D): h_ic = J_iᵀ a_ic
    if full:
        rows = pseudo.reshape(-1, pseudo.shape[-1])
        curv = rows.T @ rows  # Σ_i J_iᵀ Λ_i J_i
    else:
        curv = pseudo.square().sum((0, 1))
    return nll.detach(), grads, curv


class _PseudoLoss(Likelihood):
    r""":math:`\ell_p = a_p^\top f_p` with fixed rows ``a`` ``(P, out)``: its gradients are :math:`J_p^\top a_p`."""

    def __init__(self, coeffs: Tensor) -> None:
        self.coeffs = coeffs

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return (f * self.coeffs).sum(-1)


def _hessian_roots(likelihoods: Sequence[Likelihood], outputs: Tensor, y: Tensor) -> Tensor:
    """The Hessian square-root factors of every copy's outputs ``(R, K, M, out)``: ``(C, R·K·M, out)``, rows in
    (copy, sample, example) order; one call for copies under equal likelihoods (Bernoulli, categorical)."""
    n_copies, n_samples = outputs.shape[:2]
    f = outputs.reshape(n_copies, -1, outputs.shape[-1])  # (R, P, out), p = (k, i)
    targets = y.repeat(1, n_samples)  # (R, P)
    first = likelihoods[0]
    if all(lik == first for lik in likelihoods):
        return first.hessian_sqrt(f.flatten(0, 1), targets.flatten())
    return torch.cat([lik.hessian_sqrt(f_r, t_r) for lik, f_r, t_r in zip(likelihoods, f, targets)], dim=1)


def factored_terms(
    model: nn.Sequential,
    layout: LinearLayout,
    likelihoods: Sequence[Likelihood],
    thetas: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    curvature: Curvature,
    full: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per copy, from layer factors (module docstring), at ``thetas`` ``(R, K, D)`` on minibatches ``(R, M, ...)``:
    the NLL averaged over the K samples and M examples ``(R,)``, Σ_{k,i} g_{k,i} ``(R, D)`` and Σ_{k,i} H_{k,i}
    ``(R, D, D)`` or its diagonal ``(R, D)``. ``layout`` is ``model``'s
    :func:`~bdl_bench.curvature.per_example.linear_layout`."""
    curvature = Curvature(curvature)
    shared = len(layout.slots) == 1  # logistic regression: the data is the one layer's input for all K samples
    factors = stacked_factors(model, layout, thetas, x, y, likelihoods, share_first_input=shared)
    if curvature is Curvature.EF:
        pieces = [factors]
    else:
        roots = _hessian_roots(likelihoods, factors.outputs, y)  # (C, R·P, out)
        pseudo = [[_PseudoLoss(root)] * len(likelihoods) for root in roots]  # stacked_nll: all rows in one call
        pieces = [stacked_factors(model, layout, thetas, x, y, p, share_first_input=shared) for p in pseudo]
    sum_of = gram if full else squared_gradient_sum
    curv = sum_of(pieces[0], layout)
    for piece in pieces[1:]:
        curv += sum_of(piece, layout)
    return factors.losses.mean(dim=(1, 2)), gradient_sum(factors, layout), curv


@register_method("vogn")
class VOGN(StackedMethod):
    """Natural-gradient VI with a full or diagonal Gaussian (module docstring; ``lr`` α, ``beta`` β,
    ``n_train_mc_samples`` K). Splits can be stacked for networks of ``nn.Linear`` layers."""

    option_ranges = MappingProxyType(
        {
            "lr": POSITIVE,
            "beta": Range(0, 1, low_open=True),
            "decay": Range(0),
            "n_train_mc_samples": COUNT,
            "init_prec": Range(0),
        }
    )
    copy_state: ClassVar[tuple[str, ...]] = ("state", "_prior")
    state: VognState
    _prior: Tensor  # (R, D): each copy's prior precision λ

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
        self.keep_options(locals())

    @property
    def _full(self) -> bool:
        return self.covariance is Covariance.FULL

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """R copies of the initial state (the model's parameters, S_0 = diag(λ_r + init_prec)), stacked."""
        super().setup_stack(problems)
        n = n_params(self.problem.model)
        if self._full and n > MAX_FULL_PARAMS:
            raise ConfigError(
                f"vogn: covariance=full stores a D x D precision, but the model has D={n} parameters "
                f"(limit {MAX_FULL_PARAMS}); use covariance=diag or a low-rank method such as slang"
            )
        try:
            self._layout: LinearLayout | None = linear_layout(self.problem.model)
        except ValueError:
            self._layout = None  # not a Sequential of Linear layers: the torch.func path, one copy
        if self._layout is None and len(problems) > 1:
            raise CannotStack("method 'vogn' stacks splits only for networks of nn.Linear layers (logreg, mlp)")
        mean, self._prior = self.stacked_start()
        prec_diag = self._prior + self.init_prec
        precision = torch.diag_embed(prec_diag) if self._full else prec_diag
        self.state = VognState(mean=mean, precision=precision, step=0)

    def _sampling_cholesky(self) -> Tensor | None:
        """The Cholesky factors of a full precision (the ones the state carries, else computed); ``None`` for diag."""
        if not self._full:
            return None
        state = self.state
        return state.chol if state.chol is not None else _cholesky(state.precision, state.step)

    def _draw(self, chol: Tensor | None, n_samples: int) -> tuple[Tensor, Tensor]:
        """θ_{r,k} = μ_r + A_r ε_k with A_r A_rᵀ = S_r⁻¹ (A = L⁻ᵀ for S = L Lᵀ; S^{-1/2} for a diagonal S), the
        same K standard normals ε for every copy: θ ``(R, K, D)`` and θ − μ."""
        mean = self.state.mean
        eps = torch.randn(
            (n_samples, mean.shape[-1]), generator=self.problem.generator, dtype=mean.dtype, device=mean.device
        )
        if chol is None:
            noise = eps * self.state.precision.rsqrt()[:, None]
        else:
            noise = torch.linalg.solve_triangular(chol, eps.expand(mean.shape[0], -1, -1), upper=False, left=False)
        return mean[:, None] + noise, noise

    def _terms(self, thetas: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`factored_terms`, or for a model outside the linear layout (one copy) the torch.func path."""
        if self._layout is not None:
            likelihoods = [q.likelihood for q in self._copy_problems]
            model = self.problem.model
            return factored_terms(
                model, self._layout, likelihoods, thetas, x, y, curvature=self.curvature, full=self._full
            )
        p, (samples,), (x, y) = self.problem, thetas, (x[0], y[0])  # setup_stack allows one copy here
        nll_sum = torch.zeros((), dtype=samples.dtype, device=samples.device)
        g_sum = torch.zeros_like(samples[0])
        h_sum = torch.zeros_like(self.state.precision[0])
        for theta in samples:
            nll, grads, curv = per_example_terms(
                p.model, p.likelihood, theta, x, y, curvature=self.curvature, full=self._full
            )
            nll_sum += nll.mean()
            g_sum += grads.sum(0)
            h_sum += curv
        return (nll_sum / samples.shape[0])[None], g_sum[None], h_sum[None]

    @torch.no_grad()
    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One natural-gradient step of every copy on its minibatch (module docstring), ``x`` ``(R, M, ...)``,
        ``y`` ``(R, M)``.

        Returns ``loss`` and ``nll`` ``(R,)``: the minibatch estimates of −ELBO/N at the current q and of the
        expected NLL per example. With a diagonal precision, a copy whose new mean or precision would not be
        finite or positive keeps the old ones and reports a NaN loss, without reading the device (:meth:`fit`
        raises at the end of the epoch); with a full one, :class:`NonFiniteLossError` at once (its Cholesky reads
        the device anyway).
        """
        p, state, lam = self.problem, self.state, self._prior
        n_copies, n_samples = state.mean.shape[0], self.n_train_mc_samples
        chol = self._sampling_cholesky()
        thetas, noise = self._draw(chol, n_samples)
        nll, g_sum, h_sum = self._terms(thetas, x, y)
        scale = p.n_data / (x.shape[1] * n_samples)
        g_hat, h_hat = scale * g_sum, scale * h_sum

        step = state.step + 1
        alpha, beta = decayed_rate(self.lr, self.decay, step), decayed_rate(self.beta, self.decay, step)
        direction = g_hat + lam * state.mean
        new_chol, ok = None, None
        if self._full:
            precision = (1 - beta) * state.precision + beta * (h_hat + torch.diag_embed(lam))
            precision = 0.5 * (precision + precision.mT)
            bad = _first_bad_copy(precision, g_hat)
            if bad is not None:
                where = _in_copy(bad, n_copies)
                raise NonFiniteLossError(f"method 'vogn': non-finite precision or gradient{where} at step {step}")
            new_chol = _cholesky(precision, step)
            mean = state.mean - alpha * torch.cholesky_solve(direction[..., None], new_chol)[..., 0]
            bad = _first_bad_copy(mean)
            if bad is not None:
                raise NonFiniteLossError(f"method 'vogn': non-finite mean{_in_copy(bad, n_copies)} at step {step}")
        else:  # a bad copy keeps its state and reports NaN, unread
            precision = (1 - beta) * state.precision + beta * (h_hat + lam)
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

    def posterior(self) -> FullGaussian | DiagGaussian:
        mean, precision = self.only_copy(self.state.mean), self.only_copy(self.state.precision)
        return FullGaussian(mean, precision) if self._full else DiagGaussian(mean, precision)

    def kl_to_prior(self) -> Tensor:
        q = self.posterior()
        prior = DiagGaussian(torch.zeros_like(q.mean), self.problem.prior_precision.to(q.mean))
        return q.kl(prior)

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``(n_samples, N, out)`` network outputs at θ_k ~ q (generator: ``problem.generator``)."""
        self.only_copy(self.state.mean)
        thetas, _ = self._draw(self._sampling_cholesky(), n_samples)
        return torch.stack([forward_with(self.problem.model, th, x) for th in thetas[0]])

    def state_dict(self) -> dict[str, Any]:
        """Every copy's mean ``(R, D)``, precision and the step."""
        s = self.state
        return {"mean": s.mean.clone(), "precision": s.precision.clone(), "step": s.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (or a single run's copy-less mean ``(D,)`` and precision)."""
        mean, precision = state["mean"], state["precision"]
        like = self.state
        if mean.shape == like.mean.shape[1:] and precision.shape == like.precision.shape[1:]:
            mean, precision = mean[None], precision[None]
        if mean.shape != like.mean.shape or precision.shape != like.precision.shape:
            raise ValueError(
                f"vogn: checkpoint shapes mean {tuple(mean.shape)}, precision {tuple(precision.shape)} "
                f"do not match mean {tuple(like.mean.shape)}, precision {tuple(like.precision.shape)} "
                f"(covariance={self.covariance.value})"
            )
        if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(precision).all())):
            raise ValueError("vogn: checkpoint holds a non-finite mean or precision")
        self.state = VognState(mean=mean.to(like.mean), precision=precision.to(like.mean), step=int(state["step"]))

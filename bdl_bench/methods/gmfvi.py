r"""Gaussian mean-field VI (GMFVI) with the local reparameterisation trick and a fused closed-form KL.

The posterior of every parameter is :math:`\mathcal N(\mu_d, \sigma_d^2)` with :math:`\sigma = \operatorname{softplus}(\rho)`
(Blundell et al. 2015, Sec. 3.2; the standard GMFVI of Swiatkowski et al. 2020, Eqs. 5–6), trained as
described in ``bdl_bench.methods._layerwise_vi`` (annealed negative ELBO, Adam, local
reparameterisation, optional gradient SNR of :math:`\rho` of each weight matrix). For a linear layer
with input :math:`a` the pre-activation is drawn as (Kingma et al. 2015, Sec. 2.3)

.. math::

    a \mu_W^\top + \mu_b + \sqrt{a^2 (\sigma_W^2)^\top + \sigma_b^2} \odot \epsilon,
    \qquad \epsilon \sim \mathcal N(0, I),

two layer-sized matrix products where an SGD step has one; a convolution likewise draws every output
element from :math:`\operatorname{conv}(a, \mu_W) + \mu_b` and :math:`\operatorname{conv}(a^2, \sigma_W^2) + \sigma_b^2`.
Embedding and LSTM layers (the IMDB model) are mean-field too, every weight with its own
:math:`\sigma`; there each MC sample draws one weight vector per minibatch (the local
reparameterisation does not apply through the recurrence; ``_layerwise_vi``). The KL to the prior
:math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})` is the closed form of
:func:`bdl_bench.methods.bbb.kl_diag_to_prior`; :func:`mean_field_variance_and_kl` evaluates it together
with :math:`\sigma^2` and writes its gradient by hand (:math:`\partial/\partial\mu = \lambda\mu`,
:math:`\partial/\partial\sigma = \lambda\sigma - 1/\sigma`, chained through
:math:`\operatorname{softplus}' = \operatorname{sigmoid}`), so that the per-parameter work of a step
is a handful of passes over :math:`D` instead of a chain of autograd nodes: the elementwise overhead,
not the matrix products, is what separates a naive implementation from the 2× floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.methods._layerwise_vi import Layer, LayerwiseVI, local_reparam_conv2d, sqrt_or_tiny
from bdl_bench.methods.base import register_method
from bdl_bench.methods.bbb import local_reparam_linear, softplus_inverse, standard_normal


class _MeanFieldVarianceKL(torch.autograd.Function):
    """``(softplus(rho)**2, KL(N(mean, softplus(rho)**2) || N(0, 1/lam)), mean)`` with a hand-written backward.

    The third output is ``mean`` itself (a view): a caller that runs the network on it rather than on
    ``mean`` gets the network's gradient and the KL's added in one pass here, not by autograd's
    accumulation. ``work`` is a ``(D,)`` scratch buffer (contents ignored, overwritten), so that
    the temporaries of a step allocate no fresh memory (fresh pages are what such passes mostly cost).
    """

    @staticmethod
    def forward(
        ctx: Any, mean: Tensor, rho: Tensor, lam: Tensor, log_lam_sum: float, work: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        std = F.softplus(rho)
        var = std * std
        quad = torch.dot(lam, var) + torch.dot(lam, torch.mul(mean, mean, out=work))
        log_std_sum = torch.log(std, out=work).sum()
        kl = 0.5 * (quad - mean.numel() - log_lam_sum - 2.0 * log_std_sum)
        ctx.save_for_backward(mean, rho, std, lam)
        ctx.work = work
        return var, kl, mean.view_as(mean)

    @staticmethod
    def backward(
        ctx: Any, g_var: Tensor | None, g_kl: Tensor | None, g_mean_out: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        mean, rho, std, lam = ctx.saved_tensors
        work = ctx.work
        gk = 0.0 if g_kl is None else float(g_kl)
        g_mean = g_rho = None
        if ctx.needs_input_grad[1] and (g_kl is not None or g_var is not None):
            g_rho = torch.mul(lam, std).mul_(gk)  # dKL/dsigma = lam sigma - 1/sigma, times g_kl ...
            g_rho.sub_(torch.reciprocal(std, out=work), alpha=gk)
            if g_var is not None:
                g_rho.addcmul_(std, g_var, value=2.0)  # ... + dvar/dsigma * g_var
            g_rho.mul_(torch.sigmoid(rho, out=work))  # dsigma/drho
        if ctx.needs_input_grad[0]:
            if g_mean_out is not None:
                g_mean = torch.addcmul(g_mean_out, lam, mean, value=gk)  # + lam mu g_kl
            elif g_kl is not None:
                g_mean = torch.mul(lam, mean).mul_(gk)
        return g_mean, g_rho, None, None, None


def mean_field_variance_and_kl(
    mean: Tensor,
    rho: Tensor,
    prior_precision: Tensor,
    log_prior_precision_sum: float | None = None,
    *,
    work: Tensor | None = None,
    with_mean: bool = False,
) -> tuple[Tensor, ...]:
    r""":math:`\sigma^2 = \operatorname{softplus}(\rho)^2` and the closed-form
    :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\, \mathcal N(0, \operatorname{diag}\lambda^{-1}))`.

    Same values as ``softplus(rho)**2`` and ``bbb.kl_diag_to_prior(mean, softplus(rho), prior_precision)``,
    with a fused backward (see the module docstring).

    Args:
        mean, rho, prior_precision: flat ``(D,)`` tensors (λ > 0).
        log_prior_precision_sum: :math:`\sum_d \log\lambda_d` if already known.
        work: a ``(D,)`` scratch buffer to reuse (overwritten by the forward and the backward; it must
            not be in use elsewhere meanwhile), or ``None`` for a fresh one.
        with_mean: also return ``mean`` as a third output (a view of it) whose gradient is summed with the
            KL's in the fused backward: differentiate the rest of the objective through it.

    Returns:
        ``(var (D,), kl ())`` (and ``mean`` with ``with_mean``), differentiable in ``mean`` and ``rho``.
    """
    if log_prior_precision_sum is None:
        log_prior_precision_sum = float(torch.log(prior_precision).sum())
    if work is None:
        work = torch.empty_like(mean)
    var, kl, mean_out = _MeanFieldVarianceKL.apply(mean, rho, prior_precision, log_prior_precision_sum, work)
    return (var, kl, mean_out) if with_mean else (var, kl)


class _DiagKL(torch.autograd.Function):
    """KL(N(mean, diag std²) || N(0, diag 1/lam)) with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, mean: Tensor, std: Tensor, lam: Tensor, log_lam_sum: float) -> Tensor:
        lam_std, lam_mean = lam * std, lam * mean
        quad = torch.dot(lam_std.flatten(), std.flatten()) + torch.dot(lam_mean.flatten(), mean.flatten())
        ctx.save_for_backward(std, lam_std, lam_mean)
        return 0.5 * (quad - mean.numel() - log_lam_sum - 2.0 * torch.log(std).sum())

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        std, lam_std, lam_mean = ctx.saved_tensors
        g_mean = lam_mean * g if ctx.needs_input_grad[0] else None
        g_std = (lam_std - std.reciprocal()).mul_(g) if ctx.needs_input_grad[1] else None
        return g_mean, g_std, None, None


def diag_kl(mean: Tensor, std: Tensor, prior_precision: Tensor, log_prior_precision_sum: float | None = None) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))` of same-shaped tensors, with a fused backward
    (:math:`\lambda\mu` and :math:`\lambda\sigma - 1/\sigma`); the value of ``bbb.kl_diag_to_prior``.

    Args:
        mean, std, prior_precision: tensors of one shape (any), ``std > 0``, ``prior_precision > 0``.
        log_prior_precision_sum: :math:`\sum\log\lambda` if already known.
    """
    lam = prior_precision.expand_as(mean)
    if log_prior_precision_sum is None:
        log_prior_precision_sum = float(torch.log(lam).sum())
    return _DiagKL.apply(mean, std, lam, log_prior_precision_sum)


@dataclass(frozen=True)
class _Terms:
    var: Tensor  # (D,)  sigma^2
    var_parts: list[Tensor]  # one per model parameter
    kl: Tensor | None
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (KL's gradient fused)


@register_method("gmfvi")
class GaussianMeanFieldVI(LayerwiseVI):
    """Mean-field Gaussian VI with local reparameterisation (see the module docstring).

    Args:
        lr: Adam learning rate.
        n_train_mc_samples: MC samples S per training step.
        init_std: initial :math:`\\sigma` of every parameter (the mean starts at the model's weights).
        kl_annealing_steps: steps of linear KL annealing (0: none).
        snr_window: steps per gradient-SNR window of the weights' :math:`\\rho` (0: off).
        conv_estimator: ``"local"`` or ``"reparam"`` sampling of convolution outputs in training
            (``bdl_bench.methods._layerwise_vi``).
    """

    def _init_variational(self) -> dict[str, Tensor]:
        self.log_prior_precision_sum = float(torch.log(self.prior_precision).sum())
        self.rho = softplus_inverse(torch.full_like(self.mean, self.init_std)).requires_grad_(True)  # (D,)
        self._work = torch.empty_like(self.mean)  # scratch of the fused KL (mean_field_variance_and_kl)
        return {"rho": self.rho}

    def std(self) -> Tensor:
        """:math:`\\sigma = \\operatorname{softplus}(\\rho)`, ``(D,)`` (detached)."""
        return F.softplus(self.rho.detach())

    def _step_terms(self, with_kl: bool) -> _Terms:
        if with_kl:
            var, kl, mean = mean_field_variance_and_kl(
                self.mean,
                self.rho,
                self.prior_precision,
                self.log_prior_precision_sum,
                work=self._work,
                with_mean=True,
            )
            return _Terms(var=var, var_parts=self.split_params(var), kl=kl, mean_parts=self.split_params(mean))
        var = F.softplus(self.rho).square()
        return _Terms(var=var, var_parts=self.split_params(var), kl=None)

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        bias_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
        weight_var, g = terms.var_parts[layer.weight_param], self.problem.generator
        if isinstance(layer.module, nn.Linear):
            return local_reparam_linear(a, weight_mean, weight_var, bias_mean, bias_var, g)
        return local_reparam_conv2d(layer, a, weight_mean, weight_var, bias_mean, bias_var, g)

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        eps = standard_normal((n_samples, self.mean.numel()), self.problem.generator, self.mean)
        return self.mean + sqrt_or_tiny(terms.var) * eps

    def _param_std(self, terms: _Terms, position: int) -> Tensor:
        return sqrt_or_tiny(terms.var_parts[position])

    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        grad = self.rho.grad if self.rho.grad is not None else torch.zeros_like(self.rho)
        parts = self.split_params(grad)
        return [parts[i] for _, i in layer.weight_matrices]

    def weight_stds(self) -> list[Tensor]:
        """Every weight's matrix of standard deviations, layer by layer (detached): ``(out, in)`` for
        ``nn.Linear``, ``(C_out, C_in·kh·kw)`` for ``nn.Conv2d``, ``(4H, in)`` and ``(4H, H)`` for an
        ``nn.LSTM`` layer, ``(vocabulary, dim)`` for ``nn.Embedding``."""
        parts = self.split_params(self.std())
        return [parts[i].flatten(1) for layer in self.layers for _, i in layer.weight_matrices]

    @torch.no_grad()
    def posterior(self) -> DiagGaussian:
        """:math:`q = \\mathcal N(\\mu, \\operatorname{diag}\\sigma^2)` as precision :math:`1/\\sigma^2`."""
        return DiagGaussian(mean=self.mean.detach().clone(), prec_diag=self.std().pow(-2))

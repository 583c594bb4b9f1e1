r"""Gaussian mean-field VI (GMFVI) with the local reparameterisation trick and a fused closed-form KL.

The posterior of every parameter is :math:`\mathcal N(\mu_d, \sigma_d^2)` with :math:`\sigma = \operatorname{softplus}(\rho)`
(Blundell et al. 2015, Sec. 3.2; the standard GMFVI of Swiatkowski et al. 2020, Eqs. 5–6), trained as
described in ``bdl_bench.methods._layerwise_vi`` (annealed negative ELBO, Adam, local
reparameterisation, optional gradient SNR of :math:`\rho` of each weight matrix). For a linear layer
with input :math:`a` the pre-activation is drawn as (Kingma et al. 2015, Sec. 2.3)

.. math::

    a \mu_W^\top + \mu_b + \sqrt{a^2 (\sigma_W^2)^\top + \sigma_b^2} \odot \epsilon,
    \qquad \epsilon \sim \mathcal N(0, I),

two layer-sized matrix products where an SGD step has one; a convolution likewise (``_layerwise_vi``).
Embedding and LSTM layers (the IMDB model) are mean-field too, each MC sample drawing one weight vector per
minibatch. The KL to the prior :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})` is in closed form.

**Cost.** Beyond the layer products, a step is passes over the D parameters, and fresh ``(D,)`` tensors cost
more than passes (each is faulted in anew). So :func:`~bdl_bench.kernels.mean_field.mean_field_terms` evaluates
:math:`\sigma^2` and the KL with a hand-written backward in reused buffers (two become ``mean.grad`` and
``rho.grad``), into which a dense layer's backward (:func:`~bdl_bench.kernels.local_reparam.local_linear`)
writes its gradients directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.kernels.local_reparam import local_linear
from bdl_bench.kernels.mean_field import MeanFieldScratch, mean_field_terms
from bdl_bench.methods._diag_vi import (
    local_reparam_linear,
    softplus_inverse,
    sqrt_or_tiny,
    standard_normal,
    uniform_value,
)
from bdl_bench.methods._layerwise_vi import Layer, LayerwiseVI, conv2d
from bdl_bench.methods.base import register_method


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  sigma^2 (None in a training step of the local reparameterisation)
    var_parts: list[Tensor]  # one per model parameter
    kl: Tensor | None
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (KL's gradient fused)
    grad_parts: tuple[list[Tensor], list[Tensor]] | None = None  # where the parts' gradients go (mean, var)


@register_method("gmfvi")
class GaussianMeanFieldVI(LayerwiseVI):
    """Mean-field Gaussian VI with local reparameterisation (see the module docstring)."""

    def _init_variational(self) -> dict[str, Tensor]:
        self.log_prior_precision_sum = float(torch.log(self.prior_precision).sum())
        self._prior = uniform_value(self.prior_precision)  # lambda: one number when shared (the passes read less)
        self.rho = softplus_inverse(torch.full_like(self.mean, self.init_std)).requires_grad_(True)  # (D,)
        self._scratch = MeanFieldScratch.like(self.mean)  # the training step's buffers (mean_field_terms)
        return {"rho": self.rho}

    def _step_terms(self, with_kl: bool) -> _Terms:
        if not with_kl:
            var = F.softplus(self.rho).square()
            return _Terms(var=var, var_parts=self.split_params(var), kl=None)
        # with autograd (a training step) into the reused buffers; else (kl_to_prior) into fresh ones
        scratch = self._scratch if torch.is_grad_enabled() else MeanFieldScratch.like(self.mean)
        lam, log_lam_sum = self._prior, self.log_prior_precision_sum
        if self.local:  # the network runs on the parts: their gradients join the KL's in one backward
            t = mean_field_terms(self.mean, self.rho, lam, log_lam_sum, self.param_shapes, scratch)
            grad_parts = (t.grad_mean_parts, t.grad_var_parts)
            return _Terms(None, t.var_parts, t.kl, t.mean_parts, grad_parts)
        # whole parameter vectors are drawn from the flat variance (the mean's gradients add up in autograd)
        t = mean_field_terms(self.mean, self.rho, lam, log_lam_sum, [self.mean.shape], scratch)
        return _Terms(var=t.var_parts[0], var_parts=self.split_params(t.var_parts[0]), kl=t.kl)

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        bias_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
        weight_var, g = terms.var_parts[layer.weight_param], self.problem.generator
        if isinstance(layer.module, nn.Linear) and terms.grad_parts is not None:
            eps = standard_normal((*a.shape[:-1], weight_mean.shape[0]), g, a)
            positions = (layer.weight_param, layer.bias_param)
            into = tuple(None if i is None else parts[i] for parts in terms.grad_parts for i in positions)
            return local_linear(a, weight_mean, bias_mean, weight_var, bias_var, eps, into)
        product = F.linear if isinstance(layer.module, nn.Linear) else partial(conv2d, layer)
        return local_reparam_linear(a, weight_mean, weight_var, bias_mean, bias_var, g, product)

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        eps = standard_normal((n_samples, self.mean.numel()), self.problem.generator, self.mean)
        return self.mean + sqrt_or_tiny(terms.var) * eps

    def _param_std(self, terms: _Terms, position: int) -> Tensor:
        return sqrt_or_tiny(terms.var_parts[position])

    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        grad = self.rho.grad if self.rho.grad is not None else torch.zeros_like(self.rho)
        parts = self.split_params(grad)
        return [parts[i] for _, i in layer.weight_matrices]

    @torch.no_grad()
    def posterior(self) -> DiagGaussian:
        """:math:`q = \\mathcal N(\\mu, \\operatorname{diag}\\sigma^2)` as precision :math:`1/\\sigma^2`."""
        return DiagGaussian(mean=self.mean.detach().clone(), prec_diag=F.softplus(self.rho).pow(-2))

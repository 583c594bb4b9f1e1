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
:func:`bdl_bench.methods.bbb.kl_diag_to_prior`.

**Cost.** A step needs twice SGD's layer-sized products; the rest is passes over the D parameters, and
fresh ``(D,)`` or weight-sized tensors cost more than passes over them (each is mapped anew by the
allocator, so every page is faulted in). Hence: :func:`mean_field_terms` evaluates :math:`\sigma^2` and the
KL together and writes their gradient by hand (:math:`\partial/\partial\mu = \lambda\mu`,
:math:`\partial/\partial\sigma = \lambda\sigma - 1/\sigma`, chained through
:math:`\operatorname{softplus}' = \operatorname{sigmoid}`), in reused buffers (:class:`MeanFieldScratch`)
that become ``mean.grad`` and ``rho.grad``; a dense layer's locally reparameterised output
(:func:`local_linear`) has a hand-written backward that writes its weight gradients straight into those
buffers (``mm(out=...)``), so no per-layer gradient is allocated or concatenated; the KL's
:math:`\sum\log\sigma` takes a quarter of the logarithms (:func:`_sum_log`); a prior precision shared by
all parameters is one number. What remains beyond the 2× products is one softplus, one sigmoid, the
noise of the local reparameterisation and Adam (``scripts/bench_step.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.methods._layerwise_vi import (
    Layer,
    LayerwiseVI,
    gather_part_grads,
    local_reparam_conv2d,
    mm_into,
    reusable_grad_buffer,
    sqrt_or_tiny,
)
from bdl_bench.methods.base import register_method
from bdl_bench.methods.bbb import local_reparam_linear, softplus_inverse, standard_normal


@dataclass(frozen=True)
class MeanFieldScratch:
    r"""The ``(D,)`` buffers of :func:`mean_field_terms`, reused from step to step (fresh ``(D,)`` tensors
    are mapped anew by the allocator each time: their page faults cost more than the passes over them).

    ``std`` and ``var`` hold :math:`\sigma` and :math:`\sigma^2` from a forward to its backward, ``work``
    is scratch of either; ``grad_mean`` and ``grad_rho`` receive the gradients, which the leaves then hold
    as their ``.grad`` (until the next backward overwrites them; ``optimizer.zero_grad`` lets go of them).
    """

    std: Tensor
    var: Tensor
    work: Tensor
    grad_mean: Tensor
    grad_rho: Tensor

    @classmethod
    def like(cls, t: Tensor) -> MeanFieldScratch:
        return cls(*(torch.empty_like(t) for _ in range(5)))


def uniform_value(t: Tensor) -> Tensor | float:
    """``t``'s one value as a float if all its entries are equal (a prior precision shared by all
    coordinates, the usual case: the passes then read one tensor fewer), else ``t``."""
    first = t.reshape(-1)[0]
    return float(first) if bool((t == first).all()) else t


def _sum_log(x: Tensor, out: Tensor) -> Tensor:
    r""":math:`\sum_d \log x_d` of a positive flat ``x``, with ``out`` (``x``'s size) as scratch.

    A logarithm costs some ten times a multiplication, so the sum is taken as :math:`\ln 2 \sum_i \log_2
    (x_i x_{i+q} x_{i+2q} x_{i+3q})` over quarters of ``x`` (``log2`` is also the faster kernel): a quarter
    of the logarithms, and about 3 ulp of rounding per product. If some product leaves the normal range
    (an :math:`x_d` below about :math:`10^{-9.5}` or above :math:`10^{9.5}` in float32), the plain sum.
    """
    q = x.numel() // 4
    if q == 0:
        return torch.log(x).sum()
    quarters = x[: 4 * q].view(4, q)
    prod = torch.mul(quarters[0], quarters[1], out=out[:q]).mul_(quarters[2]).mul_(quarters[3])
    info = torch.finfo(x.dtype)
    low, high = torch.aminmax(prod)
    if not (float(low) >= info.tiny and float(high) <= info.max):
        return torch.log2(x, out=out).sum() * math.log(2.0)
    total = torch.log2(prod, out=out[q : 2 * q]).sum() + torch.log2(x[4 * q :]).sum()
    return total * math.log(2.0)


class _MeanFieldTerms(torch.autograd.Function):
    r"""``(KL, *mean parts, *variance parts)`` of :math:`q = \mathcal N(\mu, \operatorname{softplus}(\rho)^2)`
    against :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`, with a hand-written backward.

    The parts are views of ``mean`` and of ``scratch.var``, in ``shapes``. Backward, for a loss
    :math:`L = \ell(\mu, \sigma^2) + g\,\mathrm{KL}`, in a handful of passes over D into ``scratch``:

    .. math::

        \partial_\mu L = \partial_\mu \ell + g\lambda\mu, \qquad
        \partial_\rho L = \operatorname{sigmoid}(\rho)\bigl(2\sigma\,\partial_{\sigma^2}\ell
            + g(\lambda\sigma - 1/\sigma)\bigr)

    (:math:`\operatorname{softplus}' = \operatorname{sigmoid}`). The KL's value needs :math:`\sum\log\sigma`
    only; its gradient has no logarithm.
    """

    @staticmethod
    def forward(
        ctx: Any,
        mean: Tensor,
        rho: Tensor,
        lam: Tensor | float,
        log_lam_sum: float,
        shapes: list[torch.Size],
        scratch: MeanFieldScratch,
        grad_mean: Tensor,
        grad_rho: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        std = torch.ops.aten.softplus.out(rho, 1.0, 20.0, out=scratch.std)  # F.softplus, into the buffer
        var = torch.mul(std, std, out=scratch.var)
        log_std_sum = _sum_log(std, scratch.work)
        if isinstance(lam, Tensor):
            quad = torch.dot(lam, var) + torch.dot(torch.mul(lam, mean, out=scratch.work), mean)
        else:
            quad = lam * (var.sum() + torch.dot(mean, mean))
        kl = 0.5 * (quad - mean.numel() - log_lam_sum - 2.0 * log_std_sum)
        ctx.save_for_backward(mean, rho, std)  # a later forward into the same scratch fails the backward
        ctx.lam, ctx.scratch, ctx.grad_buffers = lam, scratch, (grad_mean, grad_rho)
        ctx.sizes = [math.prod(s) for s in shapes]
        split = torch.split(mean, ctx.sizes), torch.split(var, ctx.sizes)
        return (kl, *(part.view(s) for parts in split for part, s in zip(parts, shapes)))

    @staticmethod
    def backward(ctx: Any, g_kl: Tensor | None, *g_parts: Tensor | None) -> tuple[Tensor | None, ...]:
        mean, rho, std = ctx.saved_tensors
        lam, scratch, sizes, (grad_mean, grad_rho) = ctx.lam, ctx.scratch, ctx.sizes, ctx.grad_buffers
        gk = 0.0 if g_kl is None else float(g_kl)
        g_mean_parts, g_var_parts = g_parts[: len(sizes)], g_parts[len(sizes) :]
        g_mean = g_rho = None
        if ctx.needs_input_grad[0]:
            g_mean = gather_part_grads(g_mean_parts, sizes, grad_mean)
            if gk and isinstance(lam, Tensor):
                g_mean.addcmul_(lam, mean, value=gk)  # + g lam mu
            elif gk:
                g_mean.add_(mean, alpha=gk * lam)
        if ctx.needs_input_grad[1]:
            g_rho = gather_part_grads(g_var_parts, sizes, grad_rho)  # d/dvar
            torch.addcmul(std.new_zeros(()), g_rho, std, value=2.0, out=g_rho)  # * dvar/dsigma, one pass
            if gk and isinstance(lam, Tensor):
                g_rho.addcmul_(lam, std, value=gk)  # + g lam sigma
            elif gk:
                g_rho.add_(std, alpha=gk * lam)
            if gk:
                g_rho.addcdiv_(std.new_ones(()), std, value=-gk)  # - g / sigma
            g_rho.mul_(torch.sigmoid(rho, out=scratch.work))  # d sigma / d rho
        # fresh views of the buffers: AccumulateGrad then keeps them as .grad instead of copying
        g_mean, g_rho = (None if g is None else g.view_as(g) for g in (g_mean, g_rho))
        return g_mean, g_rho, None, None, None, None, None, None


@dataclass(frozen=True)
class MeanFieldParts:
    """What :func:`mean_field_terms` returns; the ``grad_*_parts`` are the parts of the buffers that the
    backward gathers the gradients of ``mean`` and of ``var`` in (:func:`local_linear` writes into them)."""

    kl: Tensor
    mean_parts: list[Tensor]
    var_parts: list[Tensor]
    grad_mean_parts: list[Tensor]
    grad_var_parts: list[Tensor]


def mean_field_terms(
    mean: Tensor,
    rho: Tensor,
    prior_precision: Tensor | float,
    log_prior_precision_sum: float,
    shapes: list[torch.Size],
    scratch: MeanFieldScratch,
) -> MeanFieldParts:
    r"""The closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))`, :math:`\sigma = \operatorname{softplus}(\rho)`, with
    :math:`\mu` and :math:`\sigma^2` split into parts of ``shapes`` (views), all differentiable in ``mean``
    and ``rho`` through one fused backward (see :class:`_MeanFieldTerms`).

    Args:
        mean, rho: flat ``(D,)`` leaves.
        prior_precision: :math:`\lambda > 0`, ``(D,)``, or one number for all coordinates.
        log_prior_precision_sum: :math:`\sum_d \log\lambda_d`.
        shapes: the parts' shapes (sizes summing to D), e.g. the model's parameter shapes.
        scratch: buffers to compute in (:class:`MeanFieldScratch`); the variance parts are views of
            ``scratch.var``, valid until the next call with the same scratch.
    """
    # the gradients' buffers, unless a leaf's .grad is one of them (a backward that accumulates)
    grad_mean = reusable_grad_buffer(mean, scratch.grad_mean)
    grad_rho = reusable_grad_buffer(rho, scratch.grad_rho)
    kl, *parts = _MeanFieldTerms.apply(
        mean, rho, prior_precision, log_prior_precision_sum, shapes, scratch, grad_mean, grad_rho
    )
    sizes = [math.prod(s) for s in shapes]

    def split(flat: Tensor) -> list[Tensor]:
        return [part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes)]

    return MeanFieldParts(kl, parts[: len(shapes)], parts[len(shapes) :], split(grad_mean), split(grad_rho))


def mean_field_variance_and_kl(
    mean: Tensor,
    rho: Tensor,
    prior_precision: Tensor,
    log_prior_precision_sum: float | None = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`\sigma^2 = \operatorname{softplus}(\rho)^2` and the closed-form KL to the prior, both
    ``(D,)``-flat, through :func:`mean_field_terms` with fresh buffers.

    Same values as ``softplus(rho)**2`` and ``bbb.kl_diag_to_prior(mean, softplus(rho), prior_precision)``.

    Returns:
        ``(var (D,), kl ())``, differentiable in ``mean`` and ``rho``.
    """
    if log_prior_precision_sum is None:
        log_prior_precision_sum = float(torch.log(prior_precision).sum())
    terms = mean_field_terms(
        mean, rho, prior_precision, log_prior_precision_sum, [mean.shape], MeanFieldScratch.like(mean)
    )
    return terms.var_parts[0], terms.kl


class _LocalLinear(torch.autograd.Function):
    r"""The locally reparameterised output of a dense layer,
    :math:`h = a\mu_W^\top + \mu_b + s \odot \epsilon` with :math:`s = \sqrt{a^2 (\sigma_W^2)^\top + \sigma_b^2}`
    (clamped as :func:`sqrt_or_tiny`), with a hand-written backward. With :math:`g = \partial L/\partial h`
    and :math:`g' = g \odot \epsilon / s` (zero where the variance was clamped), i.e. twice
    :math:`\partial L/\partial s^2`:

    .. math::

        \partial_{\mu_W} L = g^\top a, \quad \partial_{\sigma_W^2} L = \tfrac12 g'^\top a^2, \quad
        \partial_a L = g \mu_W + a \odot (g' \sigma_W^2)

    (biases: the column sums). The weight gradients are written into ``into`` (parts of
    :class:`_MeanFieldTerms`' gradient buffers), so they allocate nothing and need no gathering.
    """

    @staticmethod
    def forward(
        ctx: Any,
        a: Tensor,
        w_mean: Tensor,
        b_mean: Tensor | None,
        w_var: Tensor,
        b_var: Tensor | None,
        eps: Tensor,
        into: tuple[Tensor | None, ...],
    ) -> Tensor:
        a2 = a * a
        var = F.linear(a2, w_var, b_var)
        tiny = torch.finfo(var.dtype).tiny
        clamped = var < tiny  # where the clamp stops the gradient
        std = var.clamp_min_(tiny).sqrt_()
        ctx.save_for_backward(a, a2, w_mean, w_var, std, eps, clamped)
        ctx.into = into
        return F.linear(a, w_mean, b_mean).addcmul_(std, eps)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        a, a2, w_mean, w_var, std, eps, clamped = ctx.saved_tensors
        need_a, need_wm, need_bm, need_wv, need_bv = ctx.needs_input_grad[:5]
        into_wm, into_bm, into_wv, into_bv = ctx.into
        g2 = g.reshape(-1, g.shape[-1])
        g_var = torch.mul(g, eps).div_(std).masked_fill_(clamped, 0.0).reshape(g2.shape)  # g' = 2 dL/d(s^2)
        grads: list[Tensor | None] = [None] * 7
        if need_a:
            grads[0] = torch.matmul(g, w_mean).addcmul_(torch.matmul(g_var.view_as(g), w_var), a)
        if need_wm:
            grads[1] = mm_into(g2.t(), a.reshape(-1, a.shape[-1]), into_wm)
        if need_bm:
            grads[2] = torch.sum(g2, 0, out=into_bm) if into_bm is not None else g2.sum(0)
        if need_wv:
            grads[3] = mm_into(g_var.t(), a2.reshape(-1, a.shape[-1]), into_wv, alpha=0.5)
        if need_bv:
            grads[4] = (torch.sum(g_var, 0, out=into_bv) if into_bv is not None else g_var.sum(0)).mul_(0.5)
        return tuple(grads)


def local_linear(
    a: Tensor,
    weight_mean: Tensor,
    bias_mean: Tensor | None,
    weight_var: Tensor,
    bias_var: Tensor | None,
    eps: Tensor,
    into: tuple[Tensor | None, ...] = (None, None, None, None),
) -> Tensor:
    r"""``bbb.local_reparam_linear`` with the noise ``eps`` (``(..., out)``) given and a fused backward
    (:class:`_LocalLinear`) that writes the gradients of ``weight_mean``, ``bias_mean``, ``weight_var``
    and ``bias_var`` into the tensors of ``into`` where given (each of its parameter's shape)."""
    return _LocalLinear.apply(a, weight_mean, bias_mean, weight_var, bias_var, eps, into)


class _DiagKL(torch.autograd.Function):
    """KL(N(mean, diag std²) || N(0, diag 1/lam)) with a hand-written backward (``lam`` a tensor of the
    same shape, or one number: then no λ-scaled copies are formed)."""

    @staticmethod
    def forward(ctx: Any, mean: Tensor, std: Tensor, lam: Tensor | float, log_lam_sum: float) -> Tensor:
        if isinstance(lam, Tensor):
            lam_std, lam_mean = lam * std, lam * mean
            quad = torch.dot(lam_std.flatten(), std.flatten()) + torch.dot(lam_mean.flatten(), mean.flatten())
            ctx.save_for_backward(std, lam_std, lam_mean)
        else:
            quad = lam * (torch.dot(std.flatten(), std.flatten()) + torch.dot(mean.flatten(), mean.flatten()))
            ctx.save_for_backward(std, mean)
        ctx.lam = lam
        log_std_sum = _sum_log(std.reshape(-1), torch.empty_like(std).view(-1))
        return 0.5 * (quad - mean.numel() - log_lam_sum - 2.0 * log_std_sum)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        need_mean, need_std = ctx.needs_input_grad[:2]
        if isinstance(ctx.lam, Tensor):
            std, lam_std, lam_mean = ctx.saved_tensors
            g_mean = lam_mean * g if need_mean else None
            g_std = (lam_std - std.reciprocal()).mul_(g) if need_std else None
            return g_mean, g_std, None, None
        std, mean = ctx.saved_tensors
        scale = ctx.lam * g  # (lam mu, lam sigma - 1/sigma) g
        g_mean = mean * scale if need_mean else None
        g_std = torch.reciprocal(std).mul_(-g).add_(std * scale) if need_std else None
        return g_mean, g_std, None, None


def diag_kl(
    mean: Tensor, std: Tensor, prior_precision: Tensor | float, log_prior_precision_sum: float | None = None
) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))` of same-shaped tensors, with a fused backward
    (:math:`\lambda\mu` and :math:`\lambda\sigma - 1/\sigma`); the value of ``bbb.kl_diag_to_prior``.

    Args:
        mean, std: tensors of one shape (any), ``std > 0``.
        prior_precision: :math:`\lambda > 0`, broadcastable to it, or one number.
        log_prior_precision_sum: :math:`\sum\log\lambda` (over all of ``mean``'s entries) if already known.
    """
    if isinstance(prior_precision, Tensor):
        lam = prior_precision.expand_as(mean)
        log_sum = float(torch.log(lam).sum()) if log_prior_precision_sum is None else log_prior_precision_sum
    else:
        lam = float(prior_precision)
        log_sum = mean.numel() * math.log(lam) if log_prior_precision_sum is None else log_prior_precision_sum
    return _DiagKL.apply(mean, std, lam, log_sum)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  sigma^2 (None in a training step of the local reparameterisation)
    var_parts: list[Tensor]  # one per model parameter
    kl: Tensor | None
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (KL's gradient fused)
    grad_parts: tuple[list[Tensor], list[Tensor]] | None = None  # where the parts' gradients go (mean, var)


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
        self._prior = uniform_value(self.prior_precision)  # lambda: one number when shared (the passes read less)
        self.rho = softplus_inverse(torch.full_like(self.mean, self.init_std)).requires_grad_(True)  # (D,)
        self._scratch = MeanFieldScratch.like(self.mean)  # the training step's buffers (mean_field_terms)
        return {"rho": self.rho}

    def std(self) -> Tensor:
        """:math:`\\sigma = \\operatorname{softplus}(\\rho)`, ``(D,)`` (detached)."""
        return F.softplus(self.rho.detach())

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
            return _Terms(var=None, var_parts=t.var_parts, kl=t.kl, mean_parts=t.mean_parts, grad_parts=grad_parts)
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

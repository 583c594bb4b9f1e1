r"""GMFVI's :math:`\sigma^2 = \operatorname{softplus}(\rho)^2` and closed-form KL in one fused backward
(:func:`mean_field_terms`, in reused buffers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bdl_bench.kernels.buffers import gather_part_grads, reusable_grad_buffer
from bdl_bench.methods._diag_vi import on_host, sum_log2


@dataclass(frozen=True)
class MeanFieldScratch:
    r"""The four ``(D,)`` buffers of :func:`mean_field_terms`, reused from step to step (fresh ``(D,)`` tensors
    cost page faults). ``var`` and ``ratio`` hold :math:`\sigma^2` and :math:`\operatorname{sigmoid}(\rho)/\sigma`
    from a forward to its backward; ``grad_mean`` and ``grad_rho`` are the forward's scratch, then receive the
    gradients, which the leaves hold as ``.grad`` (:func:`reusable_grad_buffer`).
    """

    var: Tensor
    ratio: Tensor
    grad_mean: Tensor
    grad_rho: Tensor

    @classmethod
    def like(cls, t: Tensor) -> MeanFieldScratch:
        return cls(*(torch.empty_like(t) for _ in range(4)))


def _softplus_bound(x: float) -> float:
    """``F.softplus`` of one number, in double precision (NaN stays NaN, no overflow)."""
    return x if x > 20.0 else math.log1p(math.exp(x))


class _MeanFieldTerms(torch.autograd.Function):
    r"""``(KL, *mean parts, *variance parts)`` of :math:`q = \mathcal N(\mu, \operatorname{softplus}(\rho)^2)`
    against :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`, with a hand-written backward.

    The parts are views of ``mean`` and of ``scratch.var``, in ``shapes``. The forward keeps
    :math:`\sigma^2` and :math:`r = \operatorname{sigmoid}(\rho)/\sigma`; where every :math:`\rho` lies in
    :math:`[-80, 1]` (read on the host only), :math:`\sigma = -\operatorname{log1p}(-\operatorname{sigmoid}(\rho))`
    from the same sigmoid (below :math:`-80` it nears float32's subnormals, above 1 the rounding of
    :math:`1 - \operatorname{sigmoid}` grows), else ``F.softplus``. Backward, for a loss
    :math:`L = \ell(\mu, \sigma^2) + g\,\mathrm{KL}`, in a few passes over D into ``scratch``:

    .. math::

        \partial_\mu L = \partial_\mu \ell + g\lambda\mu, \qquad
        \partial_\rho L = \operatorname{sigmoid}(\rho)\bigl(2\sigma\,\partial_{\sigma^2}\ell
            + g(\lambda\sigma - 1/\sigma)\bigr)
            = \bigl((2\,\partial_{\sigma^2}\ell + g\lambda)\sigma^2 - g\bigr)\, r

    (:math:`\operatorname{softplus}' = \operatorname{sigmoid}`). The KL's value needs :math:`\sum\log\sigma`
    only (:func:`sum_log2`, bounded by :math:`\operatorname{softplus}` of the range of :math:`\rho`; off the
    host (:func:`on_host`) no bounds are read, which would wait for the device); its gradient has no logarithm.
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
        # sigma and the scratch live in the gradients' buffers until the backward writes them
        s = torch.sigmoid(rho, out=scratch.ratio)
        low_rho = high_rho = math.nan  # off the host no bounds: sum_log2 takes one logarithm per entry
        if on_host(rho):
            low_rho, high_rho = (float(v) for v in torch.aminmax(rho))
        if -80.0 <= low_rho and high_rho <= 1.0:  # softplus = -log1p(-sigmoid), within 3 ulp of F.softplus there
            std = torch.log1p(torch.neg(s, out=grad_rho), out=grad_rho).neg_()
        else:
            std = torch.ops.aten.softplus.out(rho, 1.0, 20.0, out=grad_rho)  # F.softplus, into the buffer
        ratio = s.div_(std)
        low, high = _softplus_bound(low_rho), _softplus_bound(high_rho)
        var = torch.mul(std, std, out=scratch.var)
        log2_std_sum = sum_log2(std, grad_mean, low, high)
        if isinstance(lam, Tensor):
            quad = torch.dot(lam, var).add_(torch.dot(torch.mul(lam, mean, out=grad_mean), mean)).mul_(0.5)
        else:
            quad = var.sum().add_(torch.dot(mean, mean)).mul_(0.5 * lam)
        # KL = (quad - D - sum log lam) / 2 - sum log sigma
        kl = quad.sub_(log2_std_sum, alpha=math.log(2.0)).sub_(0.5 * (mean.numel() + log_lam_sum))
        ctx.save_for_backward(mean, var, ratio)  # a later forward into the same scratch fails the backward
        ctx.lam, ctx.grad_buffers = lam, (grad_mean, grad_rho)
        ctx.sizes = [math.prod(s) for s in shapes]
        split = torch.split(mean, ctx.sizes), torch.split(var, ctx.sizes)
        return (kl, *(part.view(s) for parts in split for part, s in zip(parts, shapes)))

    @staticmethod
    def backward(ctx: Any, g_kl: Tensor | None, *g_parts: Tensor | None) -> tuple[Tensor | None, ...]:
        mean, var, ratio = ctx.saved_tensors
        lam, sizes, (grad_mean, grad_rho) = ctx.lam, ctx.sizes, ctx.grad_buffers
        # the KL's weight: a number on the host; on a device a 0-dim tensor (no synchronisation)
        gk: Tensor | float = 0.0 if g_kl is None else float(g_kl) if on_host(g_kl) else g_kl
        on_device = isinstance(gk, Tensor)
        g_mean_parts, g_var_parts = g_parts[: len(sizes)], g_parts[len(sizes) :]
        g_mean = g_rho = None
        if ctx.needs_input_grad[0]:
            g_mean = gather_part_grads(g_mean_parts, sizes, grad_mean)
            if on_device:
                g_mean.addcmul_(mean, lam * gk)  # + g lam mu
            elif gk and isinstance(lam, Tensor):
                g_mean.addcmul_(lam, mean, value=gk)
            elif gk:
                g_mean.add_(mean, alpha=gk * lam)
        if ctx.needs_input_grad[1]:
            g_rho = gather_part_grads(g_var_parts, sizes, grad_rho)  # d/dvar
            if on_device:
                g_rho.add_(lam * (0.5 * gk))  # d/dvar + g lam / 2
            elif gk and isinstance(lam, Tensor):
                g_rho.add_(lam, alpha=0.5 * gk)
            elif gk:
                g_rho.add_(0.5 * gk * lam)
            # ((2 d/dvar + g lam) var - g) * sigmoid / sigma, one pass each
            neg_gk = -gk if on_device else var.new_full((), -gk)
            torch.addcmul(neg_gk, g_rho, var, value=2.0, out=g_rho).mul_(ratio)
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
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))`, :math:`\sigma = \operatorname{softplus}(\rho)`, with the flat
    leaves :math:`\mu` and :math:`\sigma^2` split into parts of ``shapes`` (views), all differentiable in ``mean``
    and ``rho`` through one fused backward (:class:`_MeanFieldTerms`). ``prior_precision`` is ``(D,)`` or one
    number; the variance parts are views of ``scratch.var``, valid until the next call with the same scratch.
    """
    # the gradients' buffers, unless a leaf's .grad is one of them (a backward that accumulates)
    grad_mean = reusable_grad_buffer(mean, scratch.grad_mean)
    grad_rho = reusable_grad_buffer(rho, scratch.grad_rho)
    sizes = [math.prod(shape) for shape in shapes]
    grad_parts = ([p.view(shape) for p, shape in zip(torch.split(g, sizes), shapes)] for g in (grad_mean, grad_rho))
    args = (mean, rho, prior_precision, log_prior_precision_sum, shapes, scratch, grad_mean, grad_rho)
    kl, *parts = _MeanFieldTerms.apply(*args)
    return MeanFieldParts(kl, parts[: len(shapes)], parts[len(shapes) :], *grad_parts)

r"""A dense layer's locally reparameterised output (Kingma, Salimans & Welling 2015, Sec. 2.3) with a
hand-written backward: :func:`local_linear` (one copy, gradients written into buffers) and
:class:`StackedLocalLinear` (R stacked copies)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.curvature.products import t_matmul, thin_matmul
from bdl_bench.kernels.buffers import mm_into


class _LocalLinear(torch.autograd.Function):
    r"""The locally reparameterised output of a dense layer,
    :math:`h = a\mu_W^\top + \mu_b + s \odot \epsilon` with :math:`s = \sqrt{a^2 (\sigma_W^2)^\top + \sigma_b^2}`
    (clamped as :func:`sqrt_or_tiny`), with a hand-written backward. With :math:`g = \partial L/\partial h`
    and :math:`g' = g \odot \epsilon / s` (zero where the variance was clamped), i.e. twice
    :math:`\partial L/\partial s^2`:

    .. math::

        \partial_{\mu_W} L = g^\top a, \quad \partial_{\sigma_W^2} L = \tfrac12 g'^\top a^2, \quad
        \partial_a L = g \mu_W + a \odot (g' \sigma_W^2)

    (biases: the column sums). The weight gradients are written into ``into`` (parts of the gradient buffers
    of :func:`~bdl_bench.kernels.mean_field.mean_field_terms`), so they allocate nothing and need no gathering.
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
        g_var = torch.mul(g, eps).div_(std).masked_fill_(clamped, 0.0)  # g' = 2 dL/d(s^2)
        if g.dim() != 2:  # a leading sample dimension: the weight gradients sum over it too
            g2, g_var2 = g.reshape(-1, g.shape[-1]), g_var.reshape(-1, g.shape[-1])
            a_2d, a2_2d = a.reshape(-1, a.shape[-1]), a2.reshape(-1, a.shape[-1])
        else:
            g2, g_var2, a_2d, a2_2d = g, g_var, a, a2
        grads: list[Tensor | None] = [None] * 7
        if need_a:  # a (g' sigma_W^2) + g mu_W: the second product accumulated in the first's output
            grad_a = torch.mm(g_var2, w_var).view(a.shape).mul_(a)
            grads[0] = grad_a.view(-1, a.shape[-1]).addmm_(g2, w_mean).view(a.shape)
        if need_wm:
            grads[1] = mm_into(g2.t(), a_2d, into_wm)
        if need_bm:
            grads[2] = torch.sum(g2, 0, out=into_bm) if into_bm is not None else g2.sum(0)
        if need_wv:
            grads[3] = mm_into(g_var2.t(), a2_2d, into_wv, alpha=0.5)
        if need_bv:
            grads[4] = (torch.sum(g_var2, 0, out=into_bv) if into_bv is not None else g_var2.sum(0)).mul_(0.5)
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
    r""":func:`local_reparam_linear` with the noise ``eps`` (``(..., out)``) given and a fused backward
    (:class:`_LocalLinear`) that writes the gradients of ``weight_mean``, ``bias_mean``, ``weight_var``
    and ``bias_var`` into the tensors of ``into`` where given (each of its parameter's shape)."""
    return _LocalLinear.apply(a, weight_mean, bias_mean, weight_var, bias_var, eps, into)


class StackedLocalLinear(torch.autograd.Function):
    r""":class:`_LocalLinear` of R stacked copies (same forward and backward formulas): inputs ``a``
    ``(R, P, in)``, each copy's :math:`\mu_W, \sigma_W^2` ``(R, out, in)`` and :math:`\mu_b, \sigma_b^2` ``(R, out)``
    (or ``None``), noise ``eps`` ``(P, out)`` shared by the copies. An input ``a`` ``(R, M, in)`` with ``eps``
    ``(S·M, out)`` is shared by the S samples (a first layer's data): its products are taken once per example
    and g, g' summed over the samples first."""

    @staticmethod
    def forward(
        ctx: Any, a: Tensor, w_mean: Tensor, b_mean: Tensor | None, w_var: Tensor, b_var: Tensor | None, eps: Tensor
    ) -> Tensor:
        a2 = a * a
        var = torch.bmm(a2, w_var.mT) if b_var is None else torch.baddbmm(b_var.unsqueeze(1), a2, w_var.mT)
        tiny = torch.finfo(var.dtype).tiny
        clamped = var < tiny  # where the clamp stops the gradient (clamp_min's rule)
        std = var.clamp_min_(tiny).sqrt_()
        mean = torch.bmm(a, w_mean.mT) if b_mean is None else torch.baddbmm(b_mean.unsqueeze(1), a, w_mean.mT)
        ctx.save_for_backward(a, a2, w_mean, w_var, std, eps, clamped)
        ctx.has_bias = (b_mean is not None, b_var is not None)
        n_samples = eps.shape[0] // a.shape[1]
        if n_samples == 1:
            return mean.addcmul_(std, eps)
        out = torch.addcmul(mean.unsqueeze(1), std.unsqueeze(1), eps.view(n_samples, *mean.shape[1:]))
        return out.view(a.shape[0], eps.shape[0], -1)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        a, a2, w_mean, w_var, std, eps, clamped = ctx.saved_tensors
        need_a, need_wm, need_bm, need_wv, need_bv = ctx.needs_input_grad[:5]
        n_samples = eps.shape[0] // a.shape[1]
        if n_samples == 1:
            g_var = torch.mul(g, eps).div_(std).masked_fill_(clamped, 0.0)  # g' = 2 dL/d(s^2)
        else:  # the S samples' rows share a: sum g and g' over them first
            g = g.view(a.shape[0], n_samples, *std.shape[1:])
            g_var = torch.mul(g, eps.view(n_samples, *std.shape[1:])).div_(std.unsqueeze(1))
            g_var.masked_fill_(clamped.unsqueeze(1), 0.0)
            g, g_var = g.sum(1), g_var.sum(1)
        grad_a = None
        if need_a:  # a o (g' sigma_W^2) + g mu_W: the mean path's product added into the variance path's output
            grad_a = thin_matmul(g_var, w_var).mul_(a)
            if w_mean.shape[1] == 1:  # one output: g mu_W is an outer product
                grad_a.addcmul_(g, w_mean)
            else:
                grad_a.baddbmm_(g, w_mean)
        grad_wm = t_matmul(g, a) if need_wm else None  # g^T a
        grad_bm = g.sum(1) if need_bm and ctx.has_bias[0] else None
        grad_wv = t_matmul(g_var, a2).mul(0.5) if need_wv else None
        grad_bv = g_var.sum(1).mul_(0.5) if need_bv and ctx.has_bias[1] else None
        return grad_a, grad_wm, grad_bm, grad_wv, grad_bv, None

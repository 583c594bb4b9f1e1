r"""The closed-form KL of a diagonal Gaussian to the prior :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`
with a fused backward (:func:`diag_kl`), and its term in the mean (:func:`prior_quadratic`); references
:func:`diag_kl_reference` and :func:`prior_quadratic_reference`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bdl_bench.methods._diag_vi import sum_log


class _DiagKL(torch.autograd.Function):
    """KL(N(mean, diag std²) || N(0, diag 1/lam)) with a hand-written backward (``lam`` a tensor of the
    same shape, or one number: then no λ-scaled copies are formed); without ``mean`` (``None``) the KL
    less its term ½ Σ λ μ² (:func:`prior_quadratic`)."""

    @staticmethod
    def forward(
        ctx: Any, mean: Tensor | None, std: Tensor, lam: Tensor | float, log_lam_sum: float, scratch: Tensor | None
    ) -> Tensor:
        s = std.reshape(-1)
        if isinstance(lam, Tensor):
            lam_std = lam * std
            lam_mean = None if mean is None else lam * mean
            quad = torch.dot(lam_std.flatten(), s)
            if mean is not None and lam_mean is not None:
                quad = quad + torch.dot(lam_mean.flatten(), mean.flatten())
            ctx.save_for_backward(std, lam_std, lam_mean)
        else:
            quad = torch.dot(s, s)
            if mean is not None:
                m = mean.reshape(-1)
                quad.add_(torch.dot(m, m))
            quad.mul_(lam)
            ctx.save_for_backward(std, mean)
        ctx.lam = lam
        # (quad - D - sum log lam) / 2 - sum log sigma
        return quad.mul_(0.5).sub_(sum_log(s, scratch)).sub_(0.5 * (std.numel() + log_lam_sum))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        need_mean, need_std = ctx.needs_input_grad[:2]
        # (lam mu, lam sigma - 1/sigma) g; one fresh tensor per gradient (fresh memory costs more than a pass)
        if isinstance(ctx.lam, Tensor):
            std, lam_std, lam_mean = ctx.saved_tensors
            g_mean = lam_mean * g if need_mean else None
            g_std = torch.addcdiv(lam_std, std.new_ones(()), std, value=-1.0).mul_(g) if need_std else None
            return g_mean, g_std, None, None, None
        std, mean = ctx.saved_tensors
        scale = ctx.lam * g
        g_mean = mean * scale if need_mean else None
        g_std = torch.mul(std, scale).addcdiv_(g, std, value=-1.0) if need_std else None
        return g_mean, g_std, None, None, None


def diag_kl(
    mean: Tensor | None,
    std: Tensor,
    prior_precision: Tensor | float,
    log_prior_precision_sum: float | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))` of same-shaped tensors, with a fused backward
    (:math:`\lambda\mu` and :math:`\lambda\sigma - 1/\sigma`); the value of :func:`kl_diag_to_prior`.
    ``mean=None`` leaves out the term :math:`\tfrac12\sum\lambda\mu^2` (:func:`prior_quadratic`);
    ``prior_precision`` broadcasts to ``std`` or is one number; ``log_prior_precision_sum`` is
    :math:`\sum\log\lambda` if known; ``scratch`` a reused buffer of half ``std``'s size for :func:`sum_log`.
    """
    if isinstance(prior_precision, Tensor):
        lam = prior_precision.expand_as(std)
        log_sum = float(torch.log(lam).sum()) if log_prior_precision_sum is None else log_prior_precision_sum
    else:
        lam = float(prior_precision)
        log_sum = std.numel() * math.log(lam) if log_prior_precision_sum is None else log_prior_precision_sum
    return _DiagKL.apply(mean, std, lam, log_sum, scratch)


class _PriorQuadratic(torch.autograd.Function):
    """½ Σ λ μ² with the backward λ μ g in one fresh tensor (autograd of ``dot(mu, mu)`` forms two and adds)."""

    @staticmethod
    def forward(ctx: Any, mean: Tensor, lam: Tensor | float) -> Tensor:
        ctx.save_for_backward(mean)
        ctx.lam = lam
        if isinstance(lam, Tensor):
            return torch.dot(torch.mul(lam, mean).flatten(), mean.flatten()).mul_(0.5)
        return torch.dot(mean.flatten(), mean.flatten()).mul_(0.5 * lam)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        (mean,) = ctx.saved_tensors
        lam = ctx.lam
        return (torch.mul(lam, mean).mul_(g) if isinstance(lam, Tensor) else mean * (lam * g)), None


def prior_quadratic(mean: Tensor, prior_precision: Tensor | float) -> Tensor:
    r""":math:`\tfrac12\sum_d \lambda_d \mu_d^2` (``prior_precision``: ``mean``'s shape or one number), the
    KL's term in the mean, with a hand-written backward (:class:`_PriorQuadratic`)."""
    return _PriorQuadratic.apply(mean, prior_precision)


def diag_kl_reference(mean: Tensor | None, std: Tensor, prior_precision: Tensor | float) -> Tensor:
    """The plain-autograd twin of :func:`diag_kl` (``mean=None``: without the term in the mean)."""
    lam = torch.as_tensor(prior_precision, dtype=std.dtype).expand_as(std)
    var_ratio = lam * std**2
    kl = 0.5 * (var_ratio - 1 - torch.log(var_ratio)).sum()
    return kl if mean is None else kl + prior_quadratic_reference(mean, prior_precision)


def prior_quadratic_reference(mean: Tensor, prior_precision: Tensor | float) -> Tensor:
    """The plain-autograd twin of :func:`prior_quadratic`."""
    return 0.5 * (prior_precision * mean**2).sum()

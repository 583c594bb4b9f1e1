r"""The closed-form KL of a diagonal Gaussian to the prior :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`
in two parts with fused backwards, the term in the standard deviations (:func:`diag_kl`) and the one in the mean
(:func:`prior_quadratic`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bdl_bench.methods._diag_vi import sum_log


class _DiagKL(torch.autograd.Function):
    """KL(N(mean, diag std²) || N(0, diag 1/lam)) less its term ½ Σ λ μ² (:func:`prior_quadratic`), with a
    hand-written backward (``lam`` a tensor of ``std``'s shape, or one number: then no λ-scaled copy is formed)."""

    @staticmethod
    def forward(ctx: Any, std: Tensor, lam: Tensor | float, log_lam_sum: float, scratch: Tensor | None) -> Tensor:
        s = std.reshape(-1)
        if isinstance(lam, Tensor):
            lam_std = lam * std
            quad = torch.dot(lam_std.flatten(), s)
            ctx.save_for_backward(std, lam_std)
        else:
            quad = torch.dot(s, s).mul_(lam)
            ctx.save_for_backward(std)
        ctx.lam = lam
        # (quad - D - sum log lam) / 2 - sum log sigma
        return quad.mul_(0.5).sub_(sum_log(s, scratch)).sub_(0.5 * (std.numel() + log_lam_sum))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # (lam sigma - 1/sigma) g in one fresh tensor (fresh memory costs more than a pass)
        if isinstance(ctx.lam, Tensor):
            std, lam_std = ctx.saved_tensors
            return torch.addcdiv(lam_std, std.new_ones(()), std, value=-1.0).mul_(g), None, None, None
        (std,) = ctx.saved_tensors
        return torch.mul(std, ctx.lam * g).addcdiv_(g, std, value=-1.0), None, None, None


def diag_kl(
    std: Tensor,
    prior_precision: Tensor | float,
    log_prior_precision_sum: float | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))` less its term :math:`\tfrac12\sum\lambda\mu^2`
    (:func:`prior_quadratic`), with a fused backward (:math:`\lambda\sigma - 1/\sigma`): with it, the value of
    :func:`kl_diag_to_prior`. ``prior_precision`` broadcasts to ``std`` or is one number; ``log_prior_precision_sum`` is
    :math:`\sum\log\lambda` if known; ``scratch`` a reused buffer of half ``std``'s size for :func:`sum_log`.
    """
    if isinstance(prior_precision, Tensor):
        lam = prior_precision.expand_as(std)
        log_sum = float(torch.log(lam).sum()) if log_prior_precision_sum is None else log_prior_precision_sum
    else:
        lam = float(prior_precision)
        log_sum = std.numel() * math.log(lam) if log_prior_precision_sum is None else log_prior_precision_sum
    return _DiagKL.apply(std, lam, log_sum, scratch)


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

r"""The plain-autograd twins of the hand-written kernels in ``bdl_bench.kernels`` (``tests/kernels`` compares
each kernel's value and gradients with its twin), and :func:`mean_field_variance_and_kl`, GMFVI's fused terms
of the flat vectors with fresh buffers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.kernels.mean_field import MeanFieldScratch, mean_field_terms


def diag_kl_reference(std: Tensor, prior_precision: Tensor | float) -> Tensor:
    """The twin of :func:`bdl_bench.kernels.diag_vi.diag_kl`."""
    var_ratio = torch.as_tensor(prior_precision, dtype=std.dtype).expand_as(std) * std**2
    return 0.5 * (var_ratio - 1 - torch.log(var_ratio)).sum()


def prior_quadratic_reference(mean: Tensor, prior_precision: Tensor | float) -> Tensor:
    """The twin of :func:`bdl_bench.kernels.diag_vi.prior_quadratic`."""
    return 0.5 * (prior_precision * mean**2).sum()


def local_linear_reference(
    a: Tensor, w_mean: Tensor, b_mean: Tensor | None, w_var: Tensor, b_var: Tensor | None, eps: Tensor
) -> Tensor:
    r"""The twin of both kernels of :mod:`bdl_bench.kernels.local_reparam`:
    :math:`a\mu_W^\top + \mu_b + \sqrt{\max(a^2 (\sigma_W^2)^\top + \sigma_b^2, \text{tiny})} \odot \epsilon`
    (stacked: ``(R, ...)`` weights with ``(R, P, in)`` inputs)."""
    if w_mean.dim() == 3:
        mean = a @ w_mean.mT + (0 if b_mean is None else b_mean.unsqueeze(1))
        var = (a * a) @ w_var.mT + (0 if b_var is None else b_var.unsqueeze(1))
    else:
        mean, var = F.linear(a, w_mean, b_mean), F.linear(a * a, w_var, b_var)
    return mean + var.clamp_min(torch.finfo(var.dtype).tiny).sqrt() * eps


def mean_field_variance_and_kl(mean: Tensor, rho: Tensor, prior_precision: Tensor) -> tuple[Tensor, Tensor]:
    r"""``(var (D,), kl ())``: :math:`\sigma^2 = \operatorname{softplus}(\rho)^2` and the closed-form KL to the
    prior, through :func:`~bdl_bench.kernels.mean_field.mean_field_terms` with fresh buffers."""
    log_sum = float(torch.log(prior_precision).sum())
    terms = mean_field_terms(mean, rho, prior_precision, log_sum, [mean.shape], MeanFieldScratch.like(mean))
    return terms.var_parts[0], terms.kl


def mean_field_reference(mean: Tensor, rho: Tensor, prior_precision: Tensor) -> tuple[Tensor, Tensor]:
    """The twin of :func:`mean_field_variance_and_kl`: ``F.softplus`` and the closed-form KL."""
    std = F.softplus(rho)
    var_ratio = prior_precision * std**2
    return std**2, 0.5 * (var_ratio + prior_precision * mean**2 - 1 - torch.log(var_ratio)).sum()

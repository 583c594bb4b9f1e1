r"""Building blocks of the diagonal-Gaussian variational methods (it registers no method).

A factor :math:`\mathcal N(\mu, \operatorname{diag}\sigma^2)` over some or all of the flat parameters, with
:math:`\sigma = \operatorname{softplus}(\rho)`, fitted against the prior
:math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})` (``bbb``, ``gmfvi``, ``ktied``, ``elrg``, ``slang``): the
noise of the reparameterisation, the closed-form KL

.. math::

    \mathrm{KL}(q \,\|\, p) = \tfrac12 \sum_d \bigl(\lambda_d \sigma_d^2 + \lambda_d \mu_d^2 - 1
        - \log(\lambda_d \sigma_d^2)\bigr),

a linear layer's locally reparameterised pre-activation, and what the training steps read back to the host.
The hand-written backwards are in ``bdl_bench.kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def softplus_inverse(x: Tensor) -> Tensor:
    r""":math:`\rho` with :math:`\operatorname{softplus}(\rho) = x`, i.e. :math:`\log(e^x - 1)`, computed
    as :math:`x + \log(1 - e^{-x})` (stable for small and large x > 0)."""
    return x + torch.log(-torch.expm1(-x))


def standard_normal(
    shape: tuple[int, ...], generator: torch.Generator, like: Tensor, out: Tensor | None = None
) -> Tensor:
    """``N(0, 1)`` draws from ``generator`` (on its device, so a CPU generator also serves a CUDA model), moved to
    ``like``'s device with its dtype; written into ``out`` (a reused buffer) where the generator is on that device."""
    if out is not None and generator.device == like.device:
        return torch.randn(shape, generator=generator, out=out)
    eps = torch.randn(shape, generator=generator, device=generator.device, dtype=like.dtype)
    return eps.to(like.device)


def kl_diag_to_prior(mean: Tensor, std: Tensor, prior_precision: Tensor) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(\mu, \operatorname{diag}\sigma^2) \,\|\,
    \mathcal N(0, \operatorname{diag}\lambda^{-1}))` (module docstring) of ``(D,)`` inputs, or ``(R,)`` of
    stacked ``(R, D)`` ones."""
    var_ratio = prior_precision * std**2
    return 0.5 * (var_ratio + prior_precision * mean**2 - 1 - torch.log(var_ratio)).sum(-1)


def local_reparam_linear(
    a: Tensor,
    weight_mean: Tensor,
    weight_var: Tensor,
    bias_mean: Tensor | None,
    bias_var: Tensor | None,
    generator: torch.Generator,
    product: Callable[[Tensor, Tensor, Tensor | None], Tensor] = F.linear,
) -> Tensor:
    r"""Sample the pre-activation :math:`a W^\top + b` under independent Gaussian W, b, per row of ``a``
    ``(..., in)`` (Kingma, Salimans & Welling 2015, Sec. 2.3): given the input it is Gaussian with mean
    :math:`a \mu_W^\top + \mu_b` and variance :math:`a^2 (\sigma_W^2)^\top + \sigma_b^2`. Any ``product``
    ``(input, weight, bias)`` linear in the weight is sampled likewise, per output element (a convolution:
    mean :math:`\operatorname{conv}(a, \mu_W) + \mu_b`, variance
    :math:`\operatorname{conv}(a^2, \sigma_W^2) + \sigma_b^2`)."""
    mean = product(a, weight_mean, bias_mean)
    var = product(a * a, weight_var, bias_var)
    eps = standard_normal(tuple(mean.shape), generator, mean)
    return mean + sqrt_or_tiny(var) * eps


def sqrt_or_tiny(var: Tensor) -> Tensor:
    """``sqrt(var)``, with the variance clamped at the dtype's tiny so the gradient stays finite at 0."""
    return var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()


def on_host(t: Tensor) -> bool:
    """Whether ``t`` is in host memory, where reading a number from it costs nothing; elsewhere it would wait for
    the device, so the training steps keep such numbers as tensors (tests patch this to check that path)."""
    return t.device.type == "cpu"


def uniform_value(t: Tensor) -> Tensor | float:
    """``t``'s one value as a float if all its entries are equal (a prior precision shared by all coordinates:
    the passes then read one tensor fewer), else ``t``."""
    first = t.reshape(-1)[0]
    return float(first) if bool((t == first).all()) else t


def sum_log2(x: Tensor, out: Tensor, low: float, high: float) -> Tensor:
    r""":math:`\sum_d \log_2 x_d` of a positive flat ``x`` whose entries lie in ``[low, high]``, with ``out``
    (``x``'s size) as scratch.

    A logarithm costs many times a multiplication, so the entries are multiplied in groups of k (one
    ``prod`` over a ``(k, D/k)`` view; the last ``D mod k`` entries join the first groups) and the
    logarithms taken of the D/k products: k = 16, 8, 4 or 2, the largest for which every partial product
    of up to k + 1 entries stays in the normal range by the bounds (with a factor 2 to spare for
    rounding), else one logarithm per entry. Each product carries about k/2 ulp of rounding.
    """
    n, info = x.numel(), torch.finfo(x.dtype)
    if low > 0.0 and high < math.inf and out.numel() >= n // 2:  # False for NaN bounds too
        small, large = math.log(min(low, 1.0)), math.log(max(high, 1.0))
        floor, ceiling = math.log(2.0 * info.tiny), math.log(0.5 * info.max)
        for k in (16, 8, 4, 2):
            q = n // k
            if q < k or (k + 1) * small < floor or (k + 1) * large > ceiling:
                continue
            prod = torch.prod(x[: k * q].view(k, q), 0, out=out[:q])
            if n > k * q:
                prod[: n - k * q].mul_(x[k * q :])
            return torch.log2(prod, out=out[q : 2 * q]).sum()
    return torch.log2(x, out=out if out.numel() == n else None).sum()


_FEW = 4096  # below this many entries, sum_log takes one logarithm each (fewer operations)


def sum_log(x: Tensor, out: Tensor | None = None) -> Tensor:
    r""":math:`\sum_d \log x_d` of a positive flat ``x``, with ``out`` (``x``'s size) as scratch, or none:
    the logarithms of products of entries (:func:`sum_log2`, bounded by ``x``'s smallest and largest
    entry); of a few entries (fewer than 4096), one logarithm each."""
    if x.numel() < _FEW or not on_host(x):  # on a device: no bounds to read (they would wait for it)
        return torch.log(x).sum()
    low, high = torch.aminmax(x)
    if out is None:  # room for the products and their logarithms (x.numel() // 2 >= 2 x.numel() // k)
        out = x.new_empty(x.numel() // 2)
    return sum_log2(x, out, float(low), float(high)) * math.log(2.0)

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
:func:`bdl_bench.methods._diag_vi.kl_diag_to_prior`.

**Cost.** A step needs twice SGD's layer-sized products; the rest is passes over the D parameters, the
noise of the local reparameterisation (one normal per output element and example), Adam, and a few
microseconds of Python and autograd bookkeeping per operation. Fresh ``(D,)`` tensors cost more than
passes over them (each is mapped anew by the allocator, so every page is faulted in). Hence:
:func:`mean_field_terms` evaluates :math:`\sigma^2` and the KL together and writes their gradient by
hand, in four reused buffers (:class:`MeanFieldScratch`; two become ``mean.grad`` and ``rho.grad``):
:math:`\sigma` and :math:`\operatorname{sigmoid}(\rho)/\sigma` come from one ``torch.sigmoid`` and one
``log1p`` where :math:`\rho \in [-80, 1]`, else one ``exp`` and one ``log1p`` (:func:`softplus_and_ratio`;
``F.softplus`` alone costs more than both), :math:`\partial/\partial\rho` is then three passes
(:class:`_MeanFieldTerms`), and the KL's :math:`\sum\log\sigma` takes the logarithms of products of up to 16 entries (:func:`sum_log2`, safe by
the range of :math:`\sigma`, which the range of :math:`\rho` gives). In a dense network's training step
the layers' hand-written backward (:func:`local_linear`) writes the gradients of their parameters
straight into those buffers (``mm(out=...)``), and the parts they run on are plain views kept from step
to step (``layers_write_grads``): no per-layer gradient, no autograd bookkeeping per part; where every
:math:`\sigma^2` is at least twice ``tiny`` (the range of :math:`\rho` tells), a layer with a bias skips
the clamp of its output variance and its mask. A prior precision shared by all parameters is one number.
What remains beyond the 2× products is one ``sigmoid`` and one ``log1p`` over D, about a dozen cheap passes
over D, the noise and (fused) Adam: on the MNIST MLP (784-400-400-10, batch 200, one thread) some
2.6× an SGD step (``scripts/bench_step.py``, a loaded machine; the noise, ``sigmoid``/``log1p`` and Adam
alone take about half of the 0.6× above the products' 2×). On a device (:func:`on_host` false) the
forward and backward read nothing back to the host: no bounds (plain ``F.softplus``, the clamp kept),
the KL's weight kept as a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.methods._diag_vi import (
    local_reparam_linear,
    on_host,
    softplus_inverse,
    standard_normal,
    sum_log2,
    uniform_value,
)
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


@dataclass(frozen=True)
class MeanFieldScratch:
    r"""The ``(D,)`` buffers of :func:`mean_field_terms`, reused from step to step (fresh ``(D,)`` tensors
    are mapped anew by the allocator each time: their page faults cost more than the passes over them).

    ``var`` and ``ratio`` hold :math:`\sigma^2` and :math:`\operatorname{sigmoid}(\rho)/\sigma` from a forward
    to its backward; ``grad_mean`` and ``grad_rho`` are the forward's scratch (:math:`\sigma` among it),
    then receive the gradients, which the leaves then hold as their ``.grad`` (a leaf that still holds
    one when the next forward starts gets fresh buffers, :func:`reusable_grad_buffer`; once
    ``optimizer.zero_grad`` lets go of them, the next forward overwrites them). Four buffers, not more:
    the fewer the step touches, the more of them stay in cache.
    """

    var: Tensor
    ratio: Tensor
    grad_mean: Tensor
    grad_rho: Tensor
    _parts: dict = field(default_factory=dict, repr=False, compare=False)  # _split_cached's

    @classmethod
    def like(cls, t: Tensor) -> MeanFieldScratch:
        return cls(*(torch.empty_like(t) for _ in range(4)))


_SOFTPLUS_THRESHOLD = 20.0  # F.softplus's: above it softplus(x) is x, at or below it log1p(exp(x))
# where every rho lies in this range, sigma and sigmoid/sigma come from torch.sigmoid (a fast exponential):
# below -80 sigmoid nears float32's subnormals, above 1 the rounding of 1 - sigmoid(rho) grows past 3 ulp
_SIGMOID_RANGE = (-80.0, 1.0)


def _softplus_bound(x: float) -> float:
    """``F.softplus`` of one number, in double precision (NaN stays NaN, no overflow)."""
    return x if x > _SOFTPLUS_THRESHOLD else math.log1p(math.exp(x))


def softplus_and_ratio(rho: Tensor, std: Tensor, ratio: Tensor, work: Tensor) -> tuple[Tensor, Tensor, float, float]:
    r""":math:`\sigma = \operatorname{softplus}(\rho)` and :math:`r = \operatorname{sigmoid}(\rho)/\sigma`,
    written into ``std`` and ``ratio`` (``work``: scratch), and bounds on :math:`\sigma`, ``(low, high)``
    (:math:`\operatorname{softplus}` of the range of :math:`\rho`: it is increasing).

    Where every :math:`\rho` lies in :math:`[-80, 1]` (the usual case: :math:`\sigma \le 1.31`), from one
    ``torch.sigmoid`` :math:`s` (half the time of ``torch.exp``): :math:`\sigma = -\operatorname{log1p}(-s)`
    (:math:`= \log(1 + e^\rho)`, within 3 ulp of ``F.softplus`` there; below :math:`-80` :math:`s` nears
    the subnormals, above 1 the rounding of :math:`1 - s` grows) and :math:`r = s/\sigma`. Else, where
    :math:`\rho \le 20` (``F.softplus``'s threshold: below it, its formula is this one), from one
    exponential :math:`e = \exp\rho`: :math:`\sigma = \operatorname{log1p}(e)` and
    :math:`r = e / (\sigma (1 + e))` (``torch.sigmoid`` underflows to 0 for :math:`\rho < -88` in float32;
    this keeps the subnormal :math:`e`). Else ``F.softplus`` and ``torch.sigmoid`` (above the threshold
    softplus is :math:`\rho` itself, and :math:`e` may overflow). ``F.softplus`` and ``torch.sigmoid``
    alone take three times as long as either fast path. Off the host (:func:`on_host`), ``F.softplus`` and
    ``torch.sigmoid`` with no bounds (NaN), so that nothing waits for the device.
    """
    if not on_host(rho):  # no bounds: reading them would wait for the device; its passes are cheap
        torch.ops.aten.softplus.out(rho, 1.0, _SOFTPLUS_THRESHOLD, out=std)  # F.softplus, into the buffer
        return std, torch.sigmoid(rho, out=ratio).div_(std), math.nan, math.nan
    low_rho, high_rho = (float(v) for v in torch.aminmax(rho))
    bounds = _softplus_bound(low_rho), _softplus_bound(high_rho)  # NaN for NaN: no bound then
    if _SIGMOID_RANGE[0] <= low_rho and high_rho <= _SIGMOID_RANGE[1]:  # False for NaN too
        s = torch.sigmoid(rho, out=ratio)
        torch.log1p(torch.neg(s, out=std), out=std).neg_()  # softplus(rho) = -log(1 - sigmoid(rho))
        return std, ratio.div_(std), *bounds
    if high_rho <= _SOFTPLUS_THRESHOLD:
        e = torch.exp(rho, out=ratio)
        torch.log1p(e, out=std)
        return std, torch.div(e, torch.addcmul(std, std, e, out=work), out=e), *bounds  # e / (sigma (1 + e))
    torch.ops.aten.softplus.out(rho, 1.0, _SOFTPLUS_THRESHOLD, out=std)  # F.softplus, into the buffer
    return std, torch.sigmoid(rho, out=ratio).div_(std), *bounds


class _MeanFieldTerms(torch.autograd.Function):
    r"""``(KL, *mean parts, *variance parts)`` of :math:`q = \mathcal N(\mu, \operatorname{softplus}(\rho)^2)`
    against :math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})`, with a hand-written backward.

    The parts are views of ``mean`` and of ``scratch.var``, in ``shapes``; with a ``sink`` the outputs are
    ``(KL, token)`` instead, and the backward takes the parts' gradients from the buffers, where the layers
    wrote them (:class:`GradientSink`; the parts the sink does not list are zeroed). Forward, where no
    :math:`\rho` exceeds ``F.softplus``'s threshold (20), with :math:`e = \exp\rho`:
    :math:`\sigma = \operatorname{log1p}(e)` (``F.softplus``'s formula there) and
    :math:`r = \operatorname{sigmoid}(\rho)/\sigma = e / (\sigma (1 + e))`, two transcendental passes for
    both (else ``F.softplus`` and ``torch.sigmoid``). Backward, for a loss
    :math:`L = \ell(\mu, \sigma^2) + g\,\mathrm{KL}`, in a few passes over D into ``scratch``:

    .. math::

        \partial_\mu L = \partial_\mu \ell + g\lambda\mu, \qquad
        \partial_\rho L = \operatorname{sigmoid}(\rho)\bigl(2\sigma\,\partial_{\sigma^2}\ell
            + g(\lambda\sigma - 1/\sigma)\bigr)
            = \bigl((2\,\partial_{\sigma^2}\ell + g\lambda)\sigma^2 - g\bigr)\, r

    (:math:`\operatorname{softplus}' = \operatorname{sigmoid}`). The KL's value needs :math:`\sum\log\sigma`
    only (:func:`sum_log2`, bounded by the range of :math:`e`); its gradient has no logarithm.
    """

    @staticmethod
    def forward(
        ctx: Any,
        mean: Tensor,
        rho: Tensor,
        info: dict,
        lam: Tensor | float,
        log_lam_sum: float,
        shapes: list[torch.Size],
        scratch: MeanFieldScratch,
        grad_mean: Tensor,
        grad_rho: Tensor,
        sink: GradientSink | None,
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        # sigma and the scratch live in the gradients' buffers until the backward writes them
        std, ratio, low, high = softplus_and_ratio(rho, grad_rho, scratch.ratio, grad_mean)
        info["var_floor"] = low * low >= 2.0 * torch.finfo(std.dtype).tiny  # False for NaN
        var = torch.mul(std, std, out=scratch.var)
        log2_std_sum = sum_log2(std, grad_mean, low, high)
        if isinstance(lam, Tensor):
            quad = torch.dot(lam, var).add_(torch.dot(torch.mul(lam, mean, out=grad_mean), mean)).mul_(0.5)
        else:
            quad = var.sum().add_(torch.dot(mean, mean)).mul_(0.5 * lam)
        # KL = (quad - D - sum log lam) / 2 - sum log sigma
        kl = quad.sub_(log2_std_sum, alpha=math.log(2.0)).sub_(0.5 * (mean.numel() + log_lam_sum))
        ctx.save_for_backward(mean, var, ratio)  # a later forward into the same scratch fails the backward
        ctx.lam, ctx.grad_buffers, ctx.sink = lam, (grad_mean, grad_rho), sink
        ctx.sizes = [math.prod(s) for s in shapes]
        if sink is not None:  # the layers write the parts' gradients; the token orders their backward first
            return kl, mean.new_zeros(())
        split = torch.split(mean, ctx.sizes), torch.split(var, ctx.sizes)
        return (kl, *(part.view(s) for parts in split for part, s in zip(parts, shapes)))

    @staticmethod
    def backward(ctx: Any, g_kl: Tensor | None, *g_parts: Tensor | None) -> tuple[Tensor | None, ...]:
        mean, var, ratio = ctx.saved_tensors
        lam, sizes, (grad_mean, grad_rho), sink = ctx.lam, ctx.sizes, ctx.grad_buffers, ctx.sink
        # the KL's weight: a number on the host; on a device a 0-dim tensor (no synchronisation)
        gk: Tensor | float = 0.0 if g_kl is None else float(g_kl) if on_host(g_kl) else g_kl
        on_device = isinstance(gk, Tensor)
        if sink is not None:  # the parts' gradients are in the buffers already, where a layer wrote them
            for i, (g_mean_part, g_var_part) in enumerate(zip(sink.grad_mean_parts, sink.grad_var_parts)):
                if i not in sink.written:
                    g_mean_part.zero_()
                    g_var_part.zero_()
        g_mean_parts, g_var_parts = g_parts[: len(sizes)], g_parts[len(sizes) :]
        g_mean = g_rho = None
        if ctx.needs_input_grad[0]:
            g_mean = grad_mean if sink is not None else gather_part_grads(g_mean_parts, sizes, grad_mean)
            if on_device:
                g_mean.addcmul_(mean, lam * gk)  # + g lam mu
            elif gk and isinstance(lam, Tensor):
                g_mean.addcmul_(lam, mean, value=gk)
            elif gk:
                g_mean.add_(mean, alpha=gk * lam)
        if ctx.needs_input_grad[1]:
            g_rho = grad_rho if sink is not None else gather_part_grads(g_var_parts, sizes, grad_rho)  # d/dvar
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
        return g_mean, g_rho, None, None, None, None, None, None, None, None


@dataclass(eq=False)
class GradientSink:
    """Where the dense layers of one step write the gradients of the mean's and the variance's parts
    (:func:`mean_field_terms` with ``layers_write_grads``): views of the gradient buffers, and the
    positions of the parts written (the backward zeroes the others)."""

    grad_mean_parts: list[Tensor]
    grad_var_parts: list[Tensor]
    written: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class MeanFieldParts:
    """What :func:`mean_field_terms` returns; the ``grad_*_parts`` are the parts of the buffers that the
    backward gathers the gradients of ``mean`` and of ``var`` in (:func:`local_linear` writes into them).
    ``var_floor``: every variance is at least twice the dtype's ``tiny``, so a layer's output variance
    that adds a bias variance needs no clamp (:func:`local_linear`'s ``unclamped``). ``token`` and
    ``sink``: with ``layers_write_grads`` (else ``None``), what :func:`local_linear` takes instead of
    differentiable parts."""

    kl: Tensor
    mean_parts: list[Tensor]
    var_parts: list[Tensor]
    grad_mean_parts: list[Tensor]
    grad_var_parts: list[Tensor]
    var_floor: bool = False
    token: Tensor | None = None
    sink: GradientSink | None = None


def mean_field_terms(
    mean: Tensor,
    rho: Tensor,
    prior_precision: Tensor | float,
    log_prior_precision_sum: float,
    shapes: list[torch.Size],
    scratch: MeanFieldScratch,
    layers_write_grads: bool = False,
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
        layers_write_grads: the parts are plain (not differentiable) views, kept from call to call, and
            only :func:`local_linear` given ``token`` and ``sink`` may use them: it writes their gradients
            into the buffers itself (a dense network's training step; no autograd bookkeeping per part).
    """
    # the gradients' buffers, unless a leaf's .grad is one of them (a backward that accumulates)
    grad_mean = reusable_grad_buffer(mean, scratch.grad_mean)
    grad_rho = reusable_grad_buffer(rho, scratch.grad_rho)
    grad_parts = _split_cached(scratch, "grad", grad_mean, grad_rho, shapes)
    info: dict = {}  # the forward's var_floor
    args = (mean, rho, info, prior_precision, log_prior_precision_sum, shapes, scratch, grad_mean, grad_rho)
    if layers_write_grads:
        sink = GradientSink(*grad_parts)
        kl, token = _MeanFieldTerms.apply(*args, sink)
        mean_parts, var_parts = _split_cached(scratch, "value", mean, scratch.var, shapes)
        return MeanFieldParts(kl, mean_parts, var_parts, *grad_parts, info["var_floor"], token, sink)
    kl, *parts = _MeanFieldTerms.apply(*args, None)
    return MeanFieldParts(kl, parts[: len(shapes)], parts[len(shapes) :], *grad_parts, var_floor=info["var_floor"])


def _split_cached(
    scratch: MeanFieldScratch, kind: str, first: Tensor, second: Tensor, shapes: list[torch.Size]
) -> tuple[list[Tensor], list[Tensor]]:
    """``first`` and ``second`` split into parts of ``shapes`` (plain views: ``first`` detached), kept on
    ``scratch`` under ``kind`` while the tensors and shapes stay the same (the usual step)."""
    cache, key = scratch._parts.setdefault(kind, {}), tuple(shapes)
    if cache and cache["first"] is first and cache["second"] is second and cache["shapes"] == key:
        return cache["parts"]
    sizes = [math.prod(s) for s in shapes]

    def split(flat: Tensor) -> list[Tensor]:
        return [part.view(shape) for part, shape in zip(torch.split(flat.detach(), sizes), shapes)]

    parts = split(first), split(second)
    cache.update(first=first, second=second, shapes=key, parts=parts)
    return parts


def mean_field_variance_and_kl(
    mean: Tensor,
    rho: Tensor,
    prior_precision: Tensor,
    log_prior_precision_sum: float | None = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`\sigma^2 = \operatorname{softplus}(\rho)^2` and the closed-form KL to the prior, both
    ``(D,)``-flat, through :func:`mean_field_terms` with fresh buffers.

    Same values as ``softplus(rho)**2`` and ``kl_diag_to_prior(mean, softplus(rho), prior_precision)``.

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
    :class:`_MeanFieldTerms`' gradient buffers), so they allocate nothing and need no gathering. With
    ``unclamped`` the caller vouches that no variance is below ``tiny`` (a bias variance at least that
    large: the clamp would do nothing), and the clamp and its mask are skipped.
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
        unclamped: bool,
        token: Tensor | None,
        sink: tuple[GradientSink, tuple[int | None, int | None]] | None,
    ) -> Tensor:
        a2 = a * a
        var = F.linear(a2, w_var, b_var)
        clamped = None
        if not unclamped:
            tiny = torch.finfo(var.dtype).tiny
            clamped = var < tiny  # where the clamp stops the gradient
            var.clamp_min_(tiny)
        std = var.sqrt_()
        ctx.save_for_backward(a, a2, w_mean, w_var, std, eps, clamped)
        ctx.into, ctx.sink = into, sink
        return F.linear(a, w_mean, b_mean).addcmul_(std, eps)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        a, a2, w_mean, w_var, std, eps, clamped = ctx.saved_tensors
        need_a, need_wm, need_bm, need_wv, need_bv = ctx.needs_input_grad[:5]
        into_wm, into_bm, into_wv, into_bv = ctx.into
        if ctx.sink is not None:  # the parameters' gradients go to the sink's buffers only
            sink, positions = ctx.sink
            need_wm, need_bm, need_wv, need_bv = (t is not None for t in ctx.into)
            sink.written.update(i for i in positions if i is not None)
        g_var = torch.mul(g, eps).div_(std)  # g' = 2 dL/d(s^2)
        if clamped is not None:
            g_var.masked_fill_(clamped, 0.0)
        if g.dim() != 2:  # a leading sample dimension: the weight gradients sum over it too
            g2, g_var2 = g.reshape(-1, g.shape[-1]), g_var.reshape(-1, g.shape[-1])
            a_2d, a2_2d = a.reshape(-1, a.shape[-1]), a2.reshape(-1, a.shape[-1])
        else:
            g2, g_var2, a_2d, a2_2d = g, g_var, a, a2
        grads: list[Tensor | None] = [None] * 10
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
        if ctx.sink is not None:
            grads[1:5] = [None] * 4
        return tuple(grads)


def local_linear(
    a: Tensor,
    weight_mean: Tensor,
    bias_mean: Tensor | None,
    weight_var: Tensor,
    bias_var: Tensor | None,
    eps: Tensor,
    into: tuple[Tensor | None, ...] = (None, None, None, None),
    unclamped: bool = False,
    token: Tensor | None = None,
    sink: tuple[GradientSink, tuple[int | None, int | None]] | None = None,
) -> Tensor:
    r""":func:`local_reparam_linear` with the noise ``eps`` (``(..., out)``) given and a fused backward
    (:class:`_LocalLinear`) that writes the gradients of ``weight_mean``, ``bias_mean``, ``weight_var``
    and ``bias_var`` into the tensors of ``into`` where given (each of its parameter's shape).
    ``unclamped``: every output variance is known to be at least the dtype's ``tiny`` (e.g.
    ``bias_var >= tiny``), so the clamp of :func:`sqrt_or_tiny` is skipped (it would change nothing).
    ``token`` and ``sink`` (``(GradientSink, (weight position, bias position))``): the parameters are the
    plain parts of :func:`mean_field_terms` with ``layers_write_grads``; their gradients go to ``into``
    (all four given) and the sink records the positions, none to autograd; ``token`` (that call's)
    makes the terms' backward run after this one."""
    return _LocalLinear.apply(a, weight_mean, bias_mean, weight_var, bias_var, eps, into, unclamped, token, sink)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  sigma^2 (None in a training step of the local reparameterisation)
    var_parts: list[Tensor]  # one per model parameter
    kl: Tensor | None
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (KL's gradient fused)
    grad_parts: tuple[list[Tensor], list[Tensor]] | None = None  # where the parts' gradients go (mean, var)
    var_floor: bool = False  # every variance >= 2 tiny (MeanFieldParts.var_floor)
    token: Tensor | None = None  # with sink: the layers write the parts' gradients (a dense network)
    sink: GradientSink | None = None


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
            # a dense network's layers (local_linear) write the parts' gradients themselves
            fused = self.dense and torch.is_grad_enabled()
            t = mean_field_terms(self.mean, self.rho, lam, log_lam_sum, self.param_shapes, scratch, fused)
            grad_parts = (t.grad_mean_parts, t.grad_var_parts)
            return _Terms(
                var=None,
                var_parts=t.var_parts,
                kl=t.kl,
                mean_parts=t.mean_parts,
                grad_parts=grad_parts,
                var_floor=t.var_floor,
                token=t.token,
                sink=t.sink,
            )
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
            unclamped = terms.var_floor and bias_var is not None  # the output variance is >= the bias's
            sink = None if terms.sink is None else (terms.sink, positions)
            return local_linear(
                a, weight_mean, bias_mean, weight_var, bias_var, eps, into, unclamped, terms.token, sink
            )
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

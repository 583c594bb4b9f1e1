r"""ELRG-VI: Gaussian VI with a low-rank-plus-diagonal covariance per layer (Tomczak et al. 2020).

Each layer's parameters :math:`\theta_l = (\operatorname{vec} W_l, b_l) \in \mathbb R^{D_l}` get

.. math::

    q(\theta_l) = \mathcal N\Bigl(\mu_l,\; \alpha \sum_{k=1}^K v_{l,k} v_{l,k}^\top + \operatorname{diag}(\sigma_l^2)\Bigr),
    \qquad \alpha = 1/K,

a *covariance* of rank K plus a diagonal (Tomczak et al. 2020, Sec. 3; α = 1/K as in the paper). With
``learn_diag: false`` (ELRG-VI, the paper's main variant) the diagonal is the constant
:math:`\sigma^2 = ` ``init_std``² for every parameter; with ``learn_diag: true`` (ELRG-D-VI) it is learned as
:math:`\sigma = \operatorname{softplus}(\rho)`, initialised at ``init_std``.

**Forward pass (Lemma 1).** For a linear layer :math:`F_\theta(x) = x W^\top + b`, writing :math:`F_v` for
the layer with its weight and bias replaced by the corresponding parts of v,

.. math::

    F_\theta(x) \overset{d}{=} F_\mu(x) + \sqrt\alpha \sum_{k=1}^K \epsilon_k F_{v_k}(x)
        + \epsilon \odot \sqrt{F_{\sigma^2}(x^2)}, \qquad \epsilon_k \sim \mathcal N(0, 1),\;
        \epsilon \sim \mathcal N(0, I),

drawn independently per example. The K products :math:`F_{v_k}(x)` are one matrix product with a
``(K·out, in)`` weight, so a step costs (1 + K) layer-sized products forward, plus one for
:math:`F_{\sigma^2}(x^2)` when the diagonal is learned; with the constant diagonal it is
:math:`\sigma^2 (\lVert x\rVert^2 + 1)` for every output, no product at all.

**KL (Lemma 2, via the matrix determinant lemma).** Against the prior
:math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})` (the paper states it for :math:`\lambda = 1/\gamma`
constant; the per-parameter form is the same derivation), with :math:`V = [v_1 \dots v_K]`
(:func:`elrg_kl`):

.. math::

    \mathrm{KL} = \tfrac12\Bigl[\sum_d \lambda_d\bigl(\sigma_d^2 + \alpha \textstyle\sum_k v_{dk}^2 + \mu_d^2\bigr)
        - D - \sum_d \log\lambda_d - \sum_d \log\sigma_d^2
        - \log\bigl|I_K + \alpha V^\top \operatorname{diag}(\sigma^{-2}) V\bigr|\Bigr],

:math:`O(K^2 D_l + K^3)` per layer instead of :math:`O(D_l^3)`.

**Cost.** A training step of a dense network needs (1 + K) times SGD's layer-sized products; beyond
them, fresh factor-sized (``K·D_l``) or ``(D,)`` tensors cost more than passes over them (each is mapped
anew by the allocator, so every page is faulted in). Hence a training step runs through two autograd
functions with hand-written backwards that compute in buffers reused from step to step
(:class:`StepBuffers`): :class:`_ElrgTerms` returns the KL and the views of :math:`\mu`, the
:math:`v_k` (and :math:`\sigma^2`) that the network runs on, and :class:`_LowRankLocalLinear` samples a
dense layer by Lemma 1 and writes its weight gradients straight into the gradient buffers, over which
:class:`_ElrgTerms` then adds Lemma 2's gradient in place; the buffers become the leaves' ``.grad``.
Evaluation (and the KL alone) take the plain autograd route.

Initialisation (as the authors' code ``marctom/elrgvi``): :math:`\mu` = the model's weights,
:math:`v_k` = ``0.5·std(W_l)/√K`` times standard normals for the weight part and ``0.01`` times standard
normals for the bias part, drawn from the problem's generator. The gradient SNR tracked with
``snr_window`` is that of the weights' :math:`v_k` (and :math:`\rho` when learned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.methods._diag_vi import on_host, softplus_inverse, standard_normal
from bdl_bench.methods._layerwise_vi import (
    Layer,
    LayerwiseVI,
    gather_part_grads,
    mm_into,
    reusable_grad_buffer,
    sqrt_or_tiny,
)
from bdl_bench.methods.base import register_method
from bdl_bench.ranges import COUNT

_BIAS_FACTOR_SCALE = 0.01  # initial scale of the bias part of v_k (authors' code)


@dataclass
class _Block:
    """One block of coordinates of a layer (its weights, or its bias) in Lemma 2's KL (:func:`_lemma2`)."""

    mean: Tensor  # (D_b,)
    factor: Tensor  # (K, D_b)
    diag: Tensor | float  # (D_b,) or constant
    lam: Tensor | float  # (D_b,) or constant
    scaled: Tensor | None = None  # factor / diag when diag is a tensor
    lam_factor: Tensor | None = None
    lam_mean: Tensor | None = None


def _lemma2(blocks: list[_Block], alpha: float) -> tuple[Tensor, Tensor]:
    r"""Lemma 2's KL of one layer whose coordinates come in ``blocks`` that share one low-rank term (the
    Gram matrix :math:`V^\top C^{-1} V` is a sum over blocks), and :math:`G^{-1}`,
    :math:`G = I_K + \alpha V^\top C^{-1} V`. Keeps on each block what its gradient needs."""
    first = blocks[0].factor
    rank = first.shape[0]
    gram = torch.zeros(rank, rank, dtype=first.dtype, device=first.device)
    total = torch.zeros((), dtype=first.dtype, device=first.device)
    for b in blocks:
        dim = b.mean.numel()
        if isinstance(b.diag, Tensor):
            b.scaled = b.factor / b.diag  # V^T C^{-1}
            gram = gram + b.scaled @ b.factor.T
            trace_diag = torch.dot(b.lam, b.diag) if isinstance(b.lam, Tensor) else b.lam * b.diag.sum()
            logdet_diag = torch.log(b.diag).sum()
        else:
            gram = gram + (b.factor @ b.factor.T) / b.diag
            trace_diag = b.diag * (b.lam.sum() if isinstance(b.lam, Tensor) else b.lam * dim)
            logdet_diag = dim * math.log(b.diag)
        flat = b.factor.reshape(-1)
        if isinstance(b.lam, Tensor):
            b.lam_factor, b.lam_mean = b.factor * b.lam, b.mean * b.lam
            trace_low, maha = torch.dot(b.lam_factor.reshape(-1), flat), torch.dot(b.lam_mean, b.mean)
            log_lam = torch.log(b.lam).sum()
        else:
            trace_low, maha = b.lam * torch.dot(flat, flat), b.lam * torch.dot(b.mean, b.mean)
            log_lam = dim * math.log(b.lam)
        total = total + trace_diag + alpha * trace_low + maha - dim - log_lam - logdet_diag
    eye = torch.eye(rank, dtype=first.dtype, device=first.device)
    chol = torch.linalg.cholesky(eye + alpha * gram)
    logdet_gram = 2.0 * torch.log(torch.diagonal(chol)).sum()
    return 0.5 * (total - logdet_gram), torch.cholesky_inverse(chol)


def _add_factor_grad(b: _Block, gram_inv: Tensor, scale: float | Tensor, out: Tensor) -> Tensor:
    r"""``out += scale·(λ∘V^T − G^{-1} V^T C^{-1})`` in place, ``(K, D_b)``: Lemma 2's
    :math:`\partial\mathrm{KL}/\partial V^\top` is this with ``scale`` = α (see :func:`elrg_kl`). A 0-dim
    tensor ``scale`` (a weight on the device, never read on the host) scales the unit-weight gradient."""
    if isinstance(scale, Tensor):
        return out.add_(_add_factor_grad(b, gram_inv, 1.0, torch.zeros_like(out)).mul_(scale))
    if b.scaled is None and b.lam_factor is None:  # constant diagonal and prior: one (K, K) x (K, D_b) product
        eye = torch.eye(gram_inv.shape[0], dtype=gram_inv.dtype, device=gram_inv.device)
        return out.addmm_((b.lam * eye - gram_inv / b.diag) * scale, b.factor)
    if b.scaled is not None:
        out.addmm_(gram_inv, b.scaled, alpha=-scale)
    else:
        out.addmm_(gram_inv, b.factor, alpha=-scale / b.diag)
    if b.lam_factor is not None:
        return out.add_(b.lam_factor, alpha=scale)
    return out.add_(b.factor, alpha=scale * b.lam)


def _diag_grad(b: _Block, gram_inv: Tensor, alpha: float, g: float | Tensor) -> Tensor:
    r"""Lemma 2's :math:`g\,\partial\mathrm{KL}/\partial c = \tfrac g2(\lambda - 1/c + \alpha\,
    \operatorname{diag}(C^{-1} V G^{-1} V^\top C^{-1}))` of a block with a learned diagonal, ``(D_b,)``."""
    curvature = (gram_inv @ b.scaled).mul_(b.scaled).sum(0)
    return curvature.mul_(alpha).sub_(b.diag.reciprocal()).add_(b.lam).mul_(0.5 * g)


class _LowRankCovKL(torch.autograd.Function):
    """Lemma 2's KL over blocks that share one low-rank term, with a hand-written backward (:func:`elrg_kl`)."""

    @staticmethod
    def forward(ctx: Any, alpha: float, *args: Any) -> Tensor:
        blocks = [_Block(*args[i : i + 4]) for i in range(0, len(args), 4)]
        kl, gram_inv = _lemma2(blocks, alpha)
        # the blocks (inputs and intermediates) are kept on ctx rather than through save_for_backward,
        # which takes a flat tuple of tensors; the inputs are leaves or views that nothing changes in place
        ctx.alpha, ctx.blocks, ctx.gram_inv = alpha, blocks, gram_inv
        return kl

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        alpha, gram_inv = ctx.alpha, ctx.gram_inv
        gk = float(g) if on_host(g) else g  # on a device a 0-dim tensor: no synchronisation
        grads: list[Tensor | None] = [None]
        for i, b in enumerate(ctx.blocks):
            need_mean, need_factor, need_diag = ctx.needs_input_grad[1 + 4 * i : 4 + 4 * i]
            g_mean = g_factor = g_diag = None
            if need_mean:  # lambda mu
                g_mean = b.lam_mean * gk if b.lam_mean is not None else b.mean * (b.lam * gk)
            if need_factor:  # alpha (lambda V - G^{-1} V C^{-1})
                g_factor = _add_factor_grad(b, gram_inv, alpha * gk, torch.zeros_like(b.factor))
            if need_diag and b.scaled is not None:
                g_diag = _diag_grad(b, gram_inv, alpha, gk)
            grads += [g_mean, g_factor, g_diag, None]
        return tuple(grads)


def elrg_kl_blocks(blocks: list[tuple[Tensor, Tensor, Tensor | float, Tensor | float]], alpha: float) -> Tensor:
    """:func:`elrg_kl` of a Gaussian whose coordinates come in blocks ``(mean, factor, diag, prior_precision)``
    (e.g. a layer's weights and its bias), without concatenating them: the Gram matrix is a sum over blocks."""
    return _LowRankCovKL.apply(float(alpha), *(x for block in blocks for x in block))


def elrg_kl(
    mean: Tensor,
    cov_factor: Tensor,
    cov_diag: Tensor | float,
    prior_precision: Tensor | float,
    alpha: float,
) -> Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(\mu, \alpha V V^\top + \operatorname{diag} c) \,\|\, \mathcal N(0, \operatorname{diag}\lambda^{-1}))`
    by the matrix determinant lemma (Tomczak et al. 2020, Lemma 2; see the module docstring).

    The backward is written by hand (as the forward's cost, :math:`O(K^2 D)`): with
    :math:`G = I_K + \alpha V^\top C^{-1} V`,
    :math:`\partial/\partial\mu = \lambda\mu`, :math:`\partial/\partial V = \alpha(\lambda \circ V - C^{-1} V G^{-1})`
    and :math:`\partial/\partial c_d = \tfrac12(\lambda_d - 1/c_d + \alpha\, v_d^\top G^{-1} v_d / c_d^2)`
    (:math:`v_d` the d-th row of V).

    Args:
        mean: :math:`\mu`, ``(D,)``.
        cov_factor: :math:`V^\top`, ``(K, D)`` (row k is :math:`v_k`).
        cov_diag: the diagonal variances :math:`c > 0`, ``(D,)``, or one number for all.
        prior_precision: :math:`\lambda > 0`, ``(D,)``, or one number for all.
        alpha: :math:`\alpha > 0`.

    Returns:
        A scalar tensor, differentiable in every tensor argument.
    """
    return elrg_kl_blocks([(mean, cov_factor, cov_diag, prior_precision)], alpha)


@dataclass
class StepBuffers:
    r"""What a training step computes in, reused from step to step: fresh factor- or ``(D,)``-sized tensors
    are mapped anew by the allocator each time, and their page faults cost more than the passes over them.

    ``grad_mean``, ``grad_factors`` (one like each :math:`v` leaf) and ``grad_rho`` receive the gradients,
    which the leaves then hold as their ``.grad`` (until the next backward overwrites them;
    ``optimizer.zero_grad`` lets go of them); ``std`` and ``var`` hold :math:`\sigma, \sigma^2` of the
    learned diagonal from a forward to its backward, ``work`` is scratch; ``temps`` holds the
    per-layer temporaries of :class:`_LowRankLocalLinear` (:meth:`temp`).
    """

    grad_mean: Tensor
    grad_factors: list[Tensor]
    grad_rho: Tensor | None = None
    std: Tensor | None = None
    var: Tensor | None = None
    work: Tensor | None = None
    temps: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def temp(self, key: tuple[int, str], shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A reused tensor of ``shape`` (contents undefined); a new one when the shape changes (a smaller
        last minibatch)."""
        t = self.temps.get(key)
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = self.temps[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return t


@dataclass(frozen=True)
class _TermsPlan:
    """What :class:`_ElrgTerms` needs besides its tensor inputs."""

    alpha: float
    shapes: list[torch.Size]  # the model's parameter shapes (the flat order)
    layers: list[list[tuple[int, int]]]  # per layer, its blocks: (parameter position, factor position)
    prior: dict[int, Tensor | float]  # lambda per parameter position: flat, or one number
    const_var: float | None  # sigma^2 of the constant diagonal; None when learned
    grad_mean: Tensor  # this step's gradient buffers (reusable_grad_buffer)
    grad_factors: list[Tensor]
    grad_rho: Tensor | None
    buffers: StepBuffers  # std, var, work of the learned diagonal


class _ElrgTerms(torch.autograd.Function):
    r"""``(KL, *mean parts, *factors, *variance parts)`` of ELRG's q with a hand-written, fused backward.

    The parts are views of ``mean`` (in the model's parameter shapes), of the :math:`v` leaves, and (learned
    diagonal) of :math:`\sigma^2 = \operatorname{softplus}(\rho)^2`. For a loss
    :math:`L = \ell(\text{parts}) + g\,\mathrm{KL}` the backward writes into the step's buffers, in place
    over the network's gradients where a layer (:class:`_LowRankLocalLinear`) already wrote them there:

    .. math::

        \partial_\mu L = \partial_\mu\ell + g\lambda\mu, \quad
        \partial_{V^\top} L = \partial_{V^\top}\ell + g\alpha(\lambda\circ V^\top - G^{-1}V^\top C^{-1}), \quad
        \partial_\rho L = 2\sigma\operatorname{sigmoid}(\rho)\bigl(\partial_{\sigma^2}\ell + g\,\partial_c\mathrm{KL}\bigr)

    (Lemma 2's gradients, :func:`elrg_kl`), so no factor-sized gradient is allocated or summed by autograd.
    """

    @staticmethod
    def forward(ctx: Any, plan: _TermsPlan, mean: Tensor, rho: Tensor | None, *factors: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        buffers, sizes = plan.buffers, [math.prod(s) for s in plan.shapes]
        means = torch.split(mean, sizes)
        diags: tuple[Tensor, ...] | None = None
        std = None
        if rho is not None:
            std = torch.ops.aten.softplus.out(rho, 1.0, 20.0, out=buffers.std)  # F.softplus, into the buffer
            diags = torch.split(torch.mul(std, std, out=buffers.var), sizes)
        total = mean.new_zeros(())
        layers = []
        for layer in plan.layers:
            blocks = [
                _Block(means[p], factors[f].flatten(1), plan.const_var if diags is None else diags[p], plan.prior[p])
                for p, f in layer
            ]
            layer_kl, gram_inv = _lemma2(blocks, plan.alpha)
            total = total + layer_kl
            layers.append((blocks, gram_inv))
        ctx.save_for_backward(rho, std)  # a later forward into the same buffers fails this backward
        ctx.plan, ctx.layers, ctx.sizes = plan, layers, sizes
        mean_parts = [part.view(s) for part, s in zip(means, plan.shapes)]
        var_parts = [] if diags is None else [part.view(s) for part, s in zip(diags, plan.shapes)]
        return (total, *mean_parts, *(f.view_as(f) for f in factors), *var_parts)

    @staticmethod
    def backward(ctx: Any, g_kl: Tensor | None, *g_parts: Tensor | None) -> tuple[Tensor | None, ...]:
        rho, std = ctx.saved_tensors
        plan, sizes = ctx.plan, ctx.sizes
        n_params, n_factors = len(sizes), len(plan.grad_factors)
        g_means, g_factors_in = g_parts[:n_params], g_parts[n_params : n_params + n_factors]
        # the KL's weight: a number on the host; on a device a 0-dim tensor (no synchronisation)
        gk: Tensor | float = 0.0 if g_kl is None else float(g_kl) if on_host(g_kl) else g_kl
        on_device = isinstance(gk, Tensor)
        weighted = on_device or gk != 0.0
        need_mean, need_rho, need_factors = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        g_mean = gather_part_grads(g_means, sizes, plan.grad_mean) if need_mean else None
        g_var = None  # d L / d sigma^2, then d L / d rho
        if need_rho:
            g_var = gather_part_grads(g_parts[n_params + n_factors :], sizes, plan.grad_rho)
        g_factors: list[Tensor | None] = [None] * n_factors
        mean_segments = torch.split(g_mean, sizes) if g_mean is not None else None
        var_segments = torch.split(g_var, sizes) if g_var is not None else None
        for (blocks, gram_inv), layer in zip(ctx.layers, plan.layers):
            for b, (p, f) in zip(blocks, layer):
                if need_factors[f]:
                    out = plan.grad_factors[f]
                    gather_part_grads((g_factors_in[f],), [out.numel()], out.view(-1))  # the network's part
                    if weighted:
                        _add_factor_grad(b, gram_inv, plan.alpha * gk, out.view(out.shape[0], -1))
                    g_factors[f] = out.view_as(out)  # a fresh view: AccumulateGrad keeps it as .grad
                if weighted and mean_segments is not None:  # + g lambda mu
                    if on_device:
                        mean_segments[p].addcmul_(b.mean, b.lam * gk)
                    elif isinstance(b.lam, Tensor):
                        mean_segments[p].addcmul_(b.lam, b.mean, value=gk)
                    else:
                        mean_segments[p].add_(b.mean, alpha=gk * b.lam)
                if weighted and var_segments is not None:
                    var_segments[p].add_(_diag_grad(b, gram_inv, plan.alpha, gk))
        if g_var is not None:  # * d sigma^2 / d rho = 2 sigma sigmoid(rho)
            g_var.mul_(std).mul_(torch.sigmoid(rho, out=plan.buffers.work)).mul_(2.0)
        g_mean, g_var = (None if g is None else g.view_as(g) for g in (g_mean, g_var))
        return None, g_mean, g_var, *g_factors


class _LowRankLocalLinear(torch.autograd.Function):
    r"""Lemma 1's sample of a dense layer's output, with a hand-written backward that writes the weight
    gradients into the step's buffers.

    Forward, for input rows :math:`a` (leading dimensions flattened), with :math:`c_k = \sqrt\alpha\,\epsilon_k`:

    .. math::

        h = a\mu_W^\top + \mu_b + \textstyle\sum_k c_k (a V_k^\top + v_{b,k}) + s \odot \epsilon,
        \qquad s = \sqrt{F_{\sigma^2}(a^2)}

    (the K products as one, with the ``(K·out, in)`` weight, into a reused buffer; :math:`s` clamped as
    :func:`sqrt_or_tiny`). Backward, with :math:`g = \partial L/\partial h`,
    :math:`g_k = c_k g` (one ``(N, K·out)`` buffer) and :math:`g' = g \odot \epsilon / s = 2\,\partial L/\partial s^2`
    (zero where the variance was clamped):

    .. math::

        \partial_{\mu_W} L = g^\top a, \quad \partial_{V_k} L = g_k^\top a, \quad
        \partial_{\sigma_W^2} L = \tfrac12 g'^\top a^2, \quad
        \partial_a L = g\mu_W + \textstyle\sum_k g_k V_k + a \odot (g' \sigma_W^2)

    (biases: column sums). With the constant diagonal, :math:`s^2 = \sigma^2(\lVert a\rVert^2 + 1)` is one
    number per row, :math:`g'` its row sum, and :math:`\partial_a L` gets :math:`\sigma^2 g' a` instead.
    """

    @staticmethod
    def forward(
        ctx: Any,
        a: Tensor,
        w_mean: Tensor,
        b_mean: Tensor | None,
        v_weight: Tensor,
        v_bias: Tensor | None,
        w_var: Tensor | None,
        b_var: Tensor | None,
        coef: Tensor,
        eps: Tensor,
        const_var: float | None,
        into: tuple[Tensor | None, ...],
        temps: tuple[Tensor, Tensor],
    ) -> Tensor:
        rank, n_out, n_in = v_weight.shape
        a2d = a.reshape(-1, n_in)
        rows = a2d.shape[0]
        low, _ = temps
        h = torch.mm(a2d, w_mean.t()) if b_mean is None else torch.addmm(b_mean, a2d, w_mean.t())  # F_mu(x)
        v2d = v_weight.reshape(rank * n_out, n_in)
        if v_bias is None:  # the K products F_{v_k}(x)
            torch.mm(a2d, v2d.t(), out=low)
        else:
            torch.addmm(v_bias.reshape(-1), a2d, v2d.t(), out=low)
        coef = coef.reshape(rows, 1, rank)
        h.unsqueeze(1).baddbmm_(coef, low.view(rows, rank, n_out))  # + sum_k c_k F_{v_k}(x)
        a2 = None
        if const_var is None:  # F_{sigma^2}(x^2)
            a2 = a2d * a2d
            var = F.linear(a2, w_var, b_var)
        else:  # sigma^2 (|x|^2 + 1)
            var = torch.linalg.vector_norm(a2d, dim=1, keepdim=True).square_()
            var = var.add_(0.0 if b_mean is None else 1.0).mul_(const_var)
        tiny = torch.finfo(var.dtype).tiny
        clamped = var < tiny  # where the clamp stops the gradient
        std = var.clamp_min_(tiny).sqrt_()
        eps = eps.reshape(rows, n_out)
        h.addcmul_(std, eps)
        ctx.save_for_backward(a2d, a2, w_mean, v_weight, w_var, coef, eps, std, clamped)
        ctx.a_shape, ctx.const_var, ctx.into, ctx.temps = a.shape, const_var, into, temps
        return h.view(*a.shape[:-1], n_out)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        a2d, a2, w_mean, v_weight, w_var, coef, eps, std, clamped = ctx.saved_tensors
        need_a, need_wm, need_bm, need_vw, need_vb, need_wv, need_bv = ctx.needs_input_grad[:7]
        into_wm, into_bm, into_vw, into_vb, into_wv, into_bv = ctx.into
        const_var, (_, g_low) = ctx.const_var, ctx.temps
        rank, n_out, n_in = v_weight.shape
        rows = a2d.shape[0]
        g2d = g.reshape(rows, n_out)
        torch.mul(coef.view(rows, rank, 1), g2d.unsqueeze(1), out=g_low.view(rows, rank, n_out))  # g_k = c_k g
        g_var = torch.mul(g2d, eps)
        if const_var is not None:
            g_var = g_var.sum(1, keepdim=True)
        g_var.div_(std).masked_fill_(clamped, 0.0)  # g' = 2 dL/d(s^2)
        grads: list[Tensor | None] = [None] * 12
        if need_a:
            g_a = torch.mm(g2d, w_mean).addmm_(g_low, v_weight.view(rank * n_out, n_in))
            if const_var is not None:
                g_a.addcmul_(g_var, a2d, value=const_var)
            else:
                g_a.addcmul_(torch.mm(g_var, w_var), a2d)
            grads[0] = g_a.view(ctx.a_shape)
        if need_wm:
            grads[1] = mm_into(g2d.t(), a2d, into_wm)
        if need_bm:
            grads[2] = torch.sum(g2d, 0, out=into_bm) if into_bm is not None else g2d.sum(0)
        if need_vw:
            out = None if into_vw is None else into_vw.view(rank * n_out, n_in)
            grads[3] = mm_into(g_low.t(), a2d, out).view(v_weight.shape)
        if need_vb:
            g_vb = torch.sum(g_low, 0, out=into_vb.view(-1)) if into_vb is not None else g_low.sum(0)
            grads[4] = g_vb.view(rank, n_out)
        if need_wv:
            grads[5] = mm_into(g_var.t(), a2, into_wv, alpha=0.5)
        if need_bv:
            grads[6] = (torch.sum(g_var, 0, out=into_bv) if into_bv is not None else g_var.sum(0)).mul_(0.5)
        return tuple(grads)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  learned sigma^2, or None for the constant diagonal
    var_parts: list[Tensor] | None
    kl: Tensor | None
    factors: dict[int, tuple[Tensor, Tensor | None]] | None = None  # layer index -> its v_k to run on
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (one split per step)
    into: dict[int, tuple[Tensor | None, ...]] | None = None  # layer index -> where its gradients go


@register_method("elrg")
class EfficientLowRankGaussianVI(LayerwiseVI):
    """ELRG-(D-)VI (see the module docstring).

    Args:
        rank: K, the rank of each layer's low-rank covariance term.
        learn_diag: ``False``: constant diagonal ``init_std``² (ELRG-VI); ``True``: learned (ELRG-D-VI).
        lr: Adam learning rate.
        n_train_mc_samples: MC samples S per training step.
        init_std: the diagonal's standard deviation (constant, or initial when learned).
        kl_annealing_steps: steps of linear KL annealing (0: none).
        snr_window: steps per gradient-SNR window of the weights' :math:`v_k` (0: off).

    Raises:
        ValueError: if ``rank`` is not an integer >= 1 (at construction) or exceeds the number of
            parameters :math:`D_l` of some linear layer (at ``setup``), if ``learn_diag`` is not a bool,
            on the options ``gmfvi`` refuses, and (at ``setup``) naming the layer, on a model with a
            parametrised module other than ``nn.Linear`` (ELRG is implemented for dense layers only).
    """

    supported_layers = (nn.Linear,)

    option_ranges = MappingProxyType({**LayerwiseVI.option_ranges, "rank": COUNT})

    def __init__(
        self,
        *,
        rank: int,
        learn_diag: bool,
        lr: float,
        n_train_mc_samples: int,
        init_std: float,
        kl_annealing_steps: int,
        snr_window: int,
    ) -> None:
        self.check_options(locals())
        self.rank = int(rank)
        if not isinstance(learn_diag, bool):
            raise ConfigError(f"elrg: learn_diag must be true or false, got {learn_diag!r}")
        self.learn_diag = learn_diag
        self.alpha = 1.0 / self.rank
        super().__init__(
            lr=lr,
            n_train_mc_samples=n_train_mc_samples,
            init_std=init_std,
            kl_annealing_steps=kl_annealing_steps,
            snr_window=snr_window,
        )

    def _init_variational(self) -> dict[str, Tensor]:
        smallest = min(self.layers, key=lambda layer: layer.n_params)
        if self.rank > smallest.n_params:
            raise ConfigError(
                f"elrg: rank={self.rank} exceeds the {smallest.n_params} parameters of linear layer"
                f" {smallest.index} ({smallest.in_features}→{smallest.out_features}); choose"
                f" 1 <= rank <= {smallest.n_params}"
            )
        g, K = self.problem.generator, self.rank
        means = self.split_params(self.mean.detach())
        self.layer_offsets = []
        self.param_prior: dict[int, Tensor | float] = {}
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            self.layer_offsets.append(layer.slices["weight"].start)
            scale = 0.5 * float(means[layer.weight_param].std(correction=0)) / math.sqrt(K)
            shape = (K, layer.out_features, layer.in_features)
            tensors[f"v_weight{layer.index}"] = scale * standard_normal(shape, g, self.mean)
            if layer.bias_param is not None:
                shape_b = (K, layer.out_features)
                tensors[f"v_bias{layer.index}"] = _BIAS_FACTOR_SCALE * standard_normal(shape_b, g, self.mean)
            # per parameter tensor: one number when the prior precision is constant on it (the usual case)
            for index in (layer.weight_param, layer.bias_param):
                if index is not None:
                    lam = self.split_params(self.prior_precision)[index]
                    self.param_prior[index] = float(lam.flatten()[0]) if bool((lam == lam.flatten()[0]).all()) else lam
        if self.learn_diag:
            tensors["rho"] = softplus_inverse(torch.full_like(self.mean, self.init_std))
        for t in tensors.values():
            t.requires_grad_(True)
        self._factor_names = [name for name in tensors if name.startswith("v_")]
        self._kl_blocks = []  # per layer: (parameter position, factor position) of its weight and bias
        for layer in self.layers:
            kinds = [("weight", layer.weight_param), ("bias", layer.bias_param)]
            names = [(p, f"v_{kind}{layer.index}") for kind, p in kinds if p is not None]
            self._kl_blocks.append([(p, self._factor_names.index(name)) for p, name in names])
        self._flat_prior = {i: lam.flatten() if isinstance(lam, Tensor) else lam for i, lam in self.param_prior.items()}
        flat = [torch.empty_like(self.mean) for _ in range(4 if self.learn_diag else 0)]
        self._buffers = StepBuffers(
            torch.empty_like(self.mean), [torch.empty_like(tensors[n]) for n in self._factor_names], *flat
        )
        return tensors

    def _factor(self, layer: Layer) -> tuple[Tensor, Tensor | None]:
        """The weight and bias parts of the layer's :math:`v_k`: ``(K, out, in)`` and ``(K, out)`` or ``None``."""
        return self.variational[f"v_weight{layer.index}"], self.variational.get(f"v_bias{layer.index}")

    def layer_cov_factor(self, layer: Layer) -> Tensor:
        """:math:`V_l^\\top = [v_1 \\dots v_K]^\\top` in the layer's flat order (weight, then bias): ``(K, D_l)``."""
        v_weight, v_bias = self._factor(layer)
        return torch.cat([v_weight.flatten(1)] + ([] if v_bias is None else [v_bias]), dim=1)

    def layer_cov_diag(self, layer: Layer, var: Tensor | None = None) -> Tensor | float:
        """The diagonal variances of layer ``layer``: ``(D_l,)`` when learned, else one number."""
        if not self.learn_diag:
            return self.init_std**2
        var = var if var is not None else F.softplus(self.variational["rho"]).square()
        return var.narrow(0, self.layer_offsets[layer.index - 1], layer.n_params)

    def _step_terms(self, with_kl: bool) -> _Terms:
        if with_kl and self.local and torch.is_grad_enabled():  # a training step
            return self._fused_terms()
        return self._plain_terms(with_kl)

    def _plain_terms(self, with_kl: bool) -> _Terms:
        """The per-step terms by plain autograd (:func:`elrg_kl_blocks` for the KL); layers then sample by
        the plain expression of Lemma 1 (the slow twin of :meth:`_fused_terms`)."""
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        kl = means = None
        if with_kl:  # kl_to_prior, or a training step that draws whole parameter vectors
            means = self.mean_parts()  # shared with the network: one gradient gather for the mean
            diags = self.split_params(var) if var is not None else None
            terms = []
            for layer in self.layers:
                blocks = []
                for index, factor in zip((layer.weight_param, layer.bias_param), self._factor(layer)):
                    if index is not None:
                        diag = diags[index].flatten() if diags is not None else self.init_std**2
                        lam = self.param_prior[index]
                        lam = lam.flatten() if isinstance(lam, Tensor) else lam
                        blocks.append((means[index].flatten(), factor.flatten(1), diag, lam))
                terms.append(elrg_kl_blocks(blocks, self.alpha))
            kl = torch.stack(terms).sum()
        return _Terms(var=var, var_parts=None if var is None else self.split_params(var), kl=kl, mean_parts=means)

    def _fused_terms(self) -> _Terms:
        """The KL and the parts the network runs on, through :class:`_ElrgTerms`; each layer's ``into`` are
        the parts of this step's gradient buffers that :class:`_LowRankLocalLinear` writes into."""
        buffers = self._buffers
        factors = [self.variational[name] for name in self._factor_names]
        rho = self.variational.get("rho")
        # the gradients' buffers, unless a leaf's .grad is one of them (a backward that accumulates)
        grad_mean = reusable_grad_buffer(self.mean, buffers.grad_mean)
        grad_factors = [reusable_grad_buffer(f, buf) for f, buf in zip(factors, buffers.grad_factors)]
        grad_rho = None if rho is None else reusable_grad_buffer(rho, buffers.grad_rho)
        plan = _TermsPlan(
            alpha=self.alpha,
            shapes=self.param_shapes,
            layers=self._kl_blocks,
            prior=self._flat_prior,
            const_var=None if self.learn_diag else self.init_std**2,
            grad_mean=grad_mean,
            grad_factors=grad_factors,
            grad_rho=grad_rho,
            buffers=buffers,
        )
        kl, *outs = _ElrgTerms.apply(plan, self.mean, rho, *factors)
        n_params, n_factors = len(self.param_shapes), len(factors)
        mean_parts, views, var_parts = (
            outs[:n_params],
            outs[n_params : n_params + n_factors],
            outs[n_params + n_factors :],
        )
        by_name = dict(zip(self._factor_names, views))
        grads_by_name = dict(zip(self._factor_names, grad_factors))
        mean_grads = self.split_params(grad_mean)
        var_grads = None if grad_rho is None else self.split_params(grad_rho)
        factor_views, into = {}, {}
        for layer in self.layers:
            w, b, i = layer.weight_param, layer.bias_param, layer.index
            factor_views[i] = (by_name[f"v_weight{i}"], by_name.get(f"v_bias{i}"))
            into[i] = (
                mean_grads[w],
                None if b is None else mean_grads[b],
                grads_by_name[f"v_weight{i}"],
                grads_by_name.get(f"v_bias{i}"),
                None if var_grads is None else var_grads[w],
                None if var_grads is None or b is None else var_grads[b],
            )
        return _Terms(
            var=None,
            var_parts=var_parts or None,
            kl=kl,
            factors=factor_views,
            mean_parts=mean_parts,
            into=into,
        )

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        g, K, out = self.problem.generator, self.rank, layer.out_features
        if terms.into is not None:  # a training step: Lemma 1 with the hand-written backward
            v_weight, v_bias = terms.factors[layer.index]
            eps_k = standard_normal((*a.shape[:-1], 1, K), g, a)
            eps = standard_normal((*a.shape[:-1], out), g, a)
            w_var = b_var = None
            if terms.var_parts is not None:
                w_var = terms.var_parts[layer.weight_param]
                b_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
            const_var = None if self.learn_diag else self.init_std**2
            rows = a.numel() // a.shape[-1]
            temps = tuple(self._buffers.temp((layer.index, role), (rows, K * out), a) for role in ("low", "g_low"))
            coef = math.sqrt(self.alpha) * eps_k
            return _LowRankLocalLinear.apply(
                a, weight_mean, bias_mean, v_weight, v_bias, w_var, b_var, coef, eps, const_var,
                terms.into[layer.index], temps,
            )  # fmt: skip
        v_weight, v_bias = self._factor(layer)
        mean = F.linear(a, weight_mean, bias_mean)  # F_mu(x)
        # the K products F_{v_k}(x) as one product with a (K*out, in) weight
        low = F.linear(a, v_weight.view(K * out, -1), None if v_bias is None else v_bias.view(K * out))
        low = low.unflatten(-1, (K, out))  # (..., K, out)
        eps_k = standard_normal((*mean.shape[:-1], 1, K), g, mean)
        h = mean + math.sqrt(self.alpha) * (eps_k @ low).squeeze(-2)
        a2 = a * a
        if terms.var_parts is not None:  # F_{sigma^2}(x^2)
            bias_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
            var = F.linear(a2, terms.var_parts[layer.weight_param], bias_var)
        else:  # constant sigma^2: sigma^2 (|x|^2 + 1) for every output
            var = self.init_std**2 * (a2.sum(-1, keepdim=True) + (0.0 if layer.bias_param is None else 1.0))
        eps = standard_normal(tuple(mean.shape), g, mean)
        return h + sqrt_or_tiny(var) * eps

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        g = self.problem.generator
        parts: list[Tensor] = [torch.empty(0)] * len(self.param_sizes)
        for layer in self.layers:
            eps_k = standard_normal((n_samples, self.rank), g, self.mean)
            low = math.sqrt(self.alpha) * eps_k @ self.layer_cov_factor(layer)  # (S, D_l)
            parts[layer.weight_param] = low[:, : layer.n_weights]
            if layer.bias_param is not None:
                parts[layer.bias_param] = low[:, layer.n_weights :]
        low_all = torch.cat(parts, dim=1)
        eps = standard_normal((n_samples, self.mean.numel()), g, self.mean)
        diag_std = sqrt_or_tiny(terms.var) if terms.var is not None else self.init_std
        return self.mean + low_all + diag_std * eps

    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        v_weight = self._factor(layer)[0]
        grads = [v_weight.grad if v_weight.grad is not None else torch.zeros_like(v_weight)]
        if self.learn_diag:
            rho = self.variational["rho"]
            grad = rho.grad if rho.grad is not None else torch.zeros_like(rho)
            grads.append(self.split_params(grad)[layer.weight_param])
        return grads

    @torch.no_grad()
    def marginal_std(self) -> Tensor:
        """Each parameter's posterior standard deviation :math:`\\sqrt{c_d + \\alpha\\sum_k v_{dk}^2}`, ``(D,)``."""
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        blocks = []
        for layer in self.layers:
            low = self.alpha * self.layer_cov_factor(layer).square().sum(0)
            blocks.append(low + self.layer_cov_diag(layer, var))
        return torch.cat(blocks).sqrt()

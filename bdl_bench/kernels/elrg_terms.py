r"""ELRG's fused step terms (:class:`ElrgTerms`: the KL and the parts the network runs on, one backward into
reused buffers) and its dense layers' sample of Lemma 1 (:class:`LowRankLocalLinear`, reference
:func:`low_rank_local_linear_reference`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.kernels.buffers import gather_part_grads, mm_into
from bdl_bench.kernels.elrg_kl import KLBlock, add_factor_grad, diag_grad, lemma2
from bdl_bench.methods._diag_vi import on_host


@dataclass
class StepBuffers:
    r"""What a training step computes in, reused from step to step (fresh factor- or ``(D,)``-sized tensors
    cost page faults). The ``grad_*`` buffers receive the gradients, which the leaves then hold as ``.grad``."""

    grad_mean: Tensor
    grad_factors: list[Tensor]  # one like each v leaf
    grad_rho: Tensor | None = None
    std: Tensor | None = None  # sigma of the learned diagonal, from a forward to its backward
    var: Tensor | None = None  # sigma^2, likewise
    work: Tensor | None = None  # scratch
    temps: dict[str, Tensor] = field(default_factory=dict)  # LowRankLocalLinear's, a workspace_buffer's dict


@dataclass(frozen=True)
class TermsPlan:
    """What :class:`ElrgTerms` needs besides its tensor inputs."""

    alpha: float
    shapes: list[torch.Size]  # the model's parameter shapes (the flat order)
    layers: list[list[tuple[int, int]]]  # per layer, its blocks: (parameter position, factor position)
    prior: dict[int, Tensor | float]  # lambda per parameter position: flat, or one number
    const_var: float | None  # sigma^2 of the constant diagonal; None when learned
    grad_mean: Tensor  # this step's gradient buffers (reusable_grad_buffer)
    grad_factors: list[Tensor]
    grad_rho: Tensor | None
    buffers: StepBuffers  # std, var, work of the learned diagonal


class ElrgTerms(torch.autograd.Function):
    r"""``(KL, *mean parts, *factors, *variance parts)`` of ELRG's q with a hand-written, fused backward.

    The parts are views of ``mean`` (in the model's parameter shapes), of the :math:`v` leaves, and (learned
    diagonal) of :math:`\sigma^2 = \operatorname{softplus}(\rho)^2`. For a loss
    :math:`L = \ell(\text{parts}) + g\,\mathrm{KL}` the backward writes into the step's buffers, in place
    over the network's gradients where a layer (:class:`LowRankLocalLinear`) already wrote them there:

    .. math::

        \partial_\mu L = \partial_\mu\ell + g\lambda\mu, \quad
        \partial_{V^\top} L = \partial_{V^\top}\ell + g\alpha(\lambda\circ V^\top - G^{-1}V^\top C^{-1}), \quad
        \partial_\rho L = 2\sigma\operatorname{sigmoid}(\rho)\bigl(\partial_{\sigma^2}\ell + g\,\partial_c\mathrm{KL}\bigr)

    (Lemma 2's gradients, :mod:`~bdl_bench.kernels.elrg_kl`), so no factor-sized gradient is allocated or summed
    by autograd.
    """

    @staticmethod
    def forward(ctx: Any, plan: TermsPlan, mean: Tensor, rho: Tensor | None, *factors: Tensor) -> tuple[Tensor, ...]:
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
                KLBlock(means[p], factors[f].flatten(1), plan.const_var if diags is None else diags[p], plan.prior[p])
                for p, f in layer
            ]
            layer_kl, gram_inv = lemma2(blocks, plan.alpha)
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
                        add_factor_grad(b, gram_inv, plan.alpha * gk, out.view(out.shape[0], -1))
                    g_factors[f] = out.view_as(out)  # a fresh view: AccumulateGrad keeps it as .grad
                if weighted and mean_segments is not None:  # + g lambda mu
                    if on_device:
                        mean_segments[p].addcmul_(b.mean, b.lam * gk)
                    elif isinstance(b.lam, Tensor):
                        mean_segments[p].addcmul_(b.lam, b.mean, value=gk)
                    else:
                        mean_segments[p].add_(b.mean, alpha=gk * b.lam)
                if weighted and var_segments is not None:
                    var_segments[p].add_(diag_grad(b, gram_inv, plan.alpha, gk))
        if g_var is not None:  # * d sigma^2 / d rho = 2 sigma sigmoid(rho)
            g_var.mul_(std).mul_(torch.sigmoid(rho, out=plan.buffers.work)).mul_(2.0)
        g_mean, g_var = (None if g is None else g.view_as(g) for g in (g_mean, g_var))
        return None, g_mean, g_var, *g_factors


class LowRankLocalLinear(torch.autograd.Function):
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
        temps: Sequence[Tensor],
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


def low_rank_local_linear_reference(
    a: Tensor,
    w_mean: Tensor,
    b_mean: Tensor | None,
    v_weight: Tensor,
    v_bias: Tensor | None,
    w_var: Tensor | None,
    b_var: Tensor | None,
    const_var: float | None,
    eps_k: Tensor,
    eps: Tensor,
    alpha: float,
) -> Tensor:
    r"""The plain-autograd twin of :class:`LowRankLocalLinear` (Lemma 1): ``eps_k`` ``(..., 1, K)`` the
    factors' noise, ``eps`` ``(..., out)`` the diagonal's; the constant diagonal ``const_var`` gives the
    variance :math:`c(\lVert a\rVert^2 + 1)` (without a bias :math:`c\lVert a\rVert^2`)."""
    rank, n_out, _ = v_weight.shape
    low = F.linear(a, v_weight.reshape(rank * n_out, -1), None if v_bias is None else v_bias.reshape(-1))
    h = F.linear(a, w_mean, b_mean) + math.sqrt(alpha) * (eps_k @ low.unflatten(-1, (rank, n_out))).squeeze(-2)
    if const_var is None:
        var = F.linear(a * a, w_var, b_var)
    else:
        var = const_var * ((a * a).sum(-1, keepdim=True) + (0.0 if b_mean is None else 1.0))
    return h + var.clamp_min(torch.finfo(var.dtype).tiny).sqrt() * eps

r"""Per-example gradient factors of R stacked copies of a network of ``nn.Linear`` layers, one per data split
(:mod:`bdl_bench.orchestration.stacked`; a single run is R = 1), and the curvature sums built from them.

:func:`stacked_factors` evaluates the network at S parameter vectors per copy, ``(R, S, D)``, on data
``(R, M, ...)`` (:mod:`bdl_bench.curvature.per_example`): one forward/backward gives every layer's inputs A
and output gradients :math:`\Delta`, so that :math:`g_p = \operatorname{vec}(\delta_pa_p^\top)` per layer
for the P = S·M columns (sample-major: column ``s * M + i`` is example i at :math:`\theta_s`). Products with
the per-example gradient matrix G are per-layer GEMMs of those factors: :func:`gradient_sum`
(:math:`\sum_pg_p`), :func:`squared_gradient_sum` (:math:`\sum_pg_p\circ g_p`) and :func:`gram`
(:math:`\sum_pg_pg_p^\top`, the only one that forms G), used by SLANG (with :mod:`bdl_bench.curvature.gram`)
and VOGN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bdl_bench.curvature.per_example import LinearLayout
from bdl_bench.curvature.products import t_matmul_into, thin_matmul
from bdl_bench.likelihoods import Likelihood, stacked_nll


@dataclass(frozen=True)
class StackedFactors:
    """Per-example layer factors of R copies: ``inputs[l]`` ``(R, P, in_l)``, ``output_grads[l]``
    ``(R, P, out_l)`` (P = S·M, sample-major), per-example losses ``(R, S, M)`` and the network outputs
    ``(R, S, M, out)``. With ``first_input_shared``, ``inputs[0]`` is ``(R, M, in_0)``: the first layer's
    input, the same for all S samples, not repeated."""

    inputs: list[Tensor]
    output_grads: list[Tensor]
    losses: Tensor
    outputs: Tensor
    first_input_shared: bool = False

    def input_columns(self, layer: int) -> Tensor:
        """``inputs[layer]`` as ``(R, P, in)``, repeating a shared first input over the samples."""
        a = self.inputs[layer]
        if layer == 0 and self.first_input_shared:
            n_samples = self.losses.shape[1]
            return a.unsqueeze(1).expand(a.shape[0], n_samples, *a.shape[1:]).reshape(a.shape[0], -1, a.shape[-1])
        return a


def stacked_factors(
    model: nn.Sequential,
    layout: LinearLayout,
    thetas: Tensor,
    x: Tensor,
    y: Tensor,
    likelihoods: Sequence[Likelihood],
    *,
    share_first_input: bool = False,
) -> StackedFactors:
    """Layer inputs and output gradients of :math:`\\sum_{s,i}\\ell_r(f(x_{r,i};\\theta_{r,s}), y_{r,i})`.

    ``thetas`` ``(R, S, D)``, ``x`` ``(R, M, in)``, ``y`` ``(R, M)``, one likelihood per copy. With
    ``share_first_input`` the first layer takes the data as it is (one GEMM per copy for all S samples) and
    :attr:`StackedFactors.inputs` ``[0]`` is not repeated S times (cheaper for a wide input).
    """
    n_copies, n_samples = thetas.shape[:2]
    n_examples = x.shape[1]
    slot_of = {slot.module_index: slot for slot in layout.slots}
    inputs, pre_activations = [], []
    with torch.enable_grad():
        data = x.to(thetas.dtype)  # (R, M, in)
        h = None if share_first_input else data.unsqueeze(1).expand(n_copies, n_samples, *x.shape[1:])  # (R, S, M, in)
        for index, module in enumerate(model):
            slot = slot_of.get(index)
            if slot is None:
                if h is None:
                    data = module(data)
                else:
                    h = module(h)
                continue
            weight = thetas[..., slot.weight_slice].view(n_copies, n_samples, slot.out_features, slot.in_features)
            if h is None:  # the data, before the first layer: (R, M, in) x (R, in, S·out)
                z = (data @ weight.flatten(1, 2).mT).view(n_copies, n_examples, n_samples, -1).transpose(1, 2)
                inputs.append(data)
            else:
                z = thin_matmul(h, weight.mT)
                inputs.append(h.reshape(n_copies, n_samples * n_examples, slot.in_features))
            if slot.bias_slice is not None:
                z = z + thetas[..., slot.bias_slice].unsqueeze(2)
            if not z.requires_grad:
                z.requires_grad_(True)
            pre_activations.append(z)
            h = z
        losses = stacked_nll(likelihoods, h, y)  # (R, S, M)
        grads = torch.autograd.grad(losses.sum(), pre_activations)
    return StackedFactors(
        inputs=[a.detach() for a in inputs],
        output_grads=[g.reshape(n_copies, n_samples * n_examples, -1) for g in grads],
        losses=losses.detach(),
        outputs=h.detach(),
        first_input_shared=share_first_input,
    )


def gradient_sum(factors: StackedFactors, layout: LinearLayout, out: Tensor | None = None) -> Tensor:
    r""":math:`\sum_p g_p` of every copy, ``(R, D)`` (into ``out`` if given): per layer :math:`\Delta^\top A` and
    the summed deltas."""
    return _layer_sums(factors, layout, out, squared=False)


def squared_gradient_sum(factors: StackedFactors, layout: LinearLayout, out: Tensor | None = None) -> Tensor:
    r""":math:`\sum_p g_p\circ g_p` of every copy, ``(R, D)`` (into ``out`` if given): per layer
    :math:`(\Delta^{\circ2})^\top A^{\circ2}` (no per-example gradient is formed)."""
    return _layer_sums(factors, layout, out, squared=True)


def _layer_sums(factors: StackedFactors, layout: LinearLayout, out: Tensor | None, squared: bool) -> Tensor:
    if out is None:
        out = factors.output_grads[0].new_empty(factors.losses.shape[0], layout.n_params)
    for layer, (slot, a, d) in enumerate(zip(layout.slots, factors.inputs, factors.output_grads)):
        if squared:
            a, d = a.square(), d.square()
        if layer == 0 and factors.first_input_shared:  # sum over the samples first
            d = d.view(d.shape[0], factors.losses.shape[1], -1, d.shape[-1]).sum(1)
        t_matmul_into(d, a, out[:, slot.weight_slice].view(out.shape[0], slot.out_features, slot.in_features))
        if slot.bias_slice is not None:
            torch.sum(d, 1, out=out[:, slot.bias_slice])
    return out


def gradient_columns(factors: StackedFactors, layout: LinearLayout) -> Tensor:
    r"""The per-example gradients :math:`g_p = \operatorname{vec}(\delta_pa_p^\top)` of every copy, ``(R, P, D)``
    in flat parameter order (for :math:`\sum_p g_pg_p^\top = G^\top G`)."""
    first = factors.output_grads[0]
    n_copies, n_cols = first.shape[:2]
    out = first.new_empty(n_copies, n_cols, layout.n_params)
    for layer, (slot, delta) in enumerate(zip(layout.slots, factors.output_grads)):
        a = factors.input_columns(layer)
        out[..., slot.weight_slice] = (delta[..., :, None] * a[..., None, :]).reshape(n_copies, n_cols, -1)
        if slot.bias_slice is not None:
            out[..., slot.bias_slice] = delta
    return out


def gram(factors: StackedFactors, layout: LinearLayout) -> Tensor:
    r""":math:`\sum_pg_pg_p^\top` of every copy, ``(R, D, D)``. For one linear layer with one output on a shared
    input (logistic regression), :math:`g_{ki} = \delta_{ki}\tilde x_i`, so the sum is
    :math:`\sum_i(\sum_k\delta_{ki}^2)\tilde x_i\tilde x_i^\top`: M columns instead of S·M."""
    (slot,) = layout.slots if len(layout.slots) == 1 else (None,)
    if slot is not None and slot.out_features == 1 and factors.first_input_shared:
        d = factors.output_grads[0]
        weights = d.square().view(d.shape[0], factors.losses.shape[1], -1).sum(1)  # (R, M)
        x = factors.inputs[0]
        columns = x.new_empty(*x.shape[:2], layout.n_params)  # rows [x_i, 1] in flat order
        columns[..., slot.weight_slice] = x
        if slot.bias_slice is not None:
            columns[..., slot.bias_slice] = 1.0
        columns *= weights.sqrt().unsqueeze(-1)
    else:
        columns = gradient_columns(factors, layout)
    return columns.mT @ columns

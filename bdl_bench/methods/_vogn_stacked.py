r"""VOGN's update (:meth:`bdl_bench.methods.vogn.VOGN.update`) for R stacked copies, one per data split.

The same maths as the single run — SLANG, Appendix A eqs. (12)–(13) — with a leading copy dimension R on
the mean ``(R, D)`` and the precision ``(R, D, D)`` (``covariance=full``) or ``(R, D)`` (``diag``), for
networks of ``nn.Linear`` layers. Meant for SLANG's Table 1 (logistic regression, D ≤ 257, 10,000
epochs of minibatches of 32–128 examples): there a single run's cost is Python overhead per step
(milliseconds for a few hundred flops), which one stacked step shares among the R splits.

Per copy, the P = K·M per-example gradients come from one stacked forward/backward
(:func:`bdl_bench.methods._slang_stacked.stacked_factors`: layer inputs A and output gradients
:math:`\Delta`); their sum and squared sum are GEMMs of those factors, and only the full covariance forms
them as an ``(R, P, D)`` matrix G (the single run's :func:`~bdl_bench.methods.vogn.factored_terms` is the
twin): the empirical Fisher is :math:`G^\top G`; the Gauss–Newton matrix is
:math:`\sum_c H_c^\top H_c` with :math:`H_c` the gradients of the pseudo-losses :math:`a_{pc}^\top f_p`,
:math:`\Lambda_p = \sum_c a_{pc}a_{pc}^\top` (:func:`~bdl_bench.methods.vogn.output_hessian_sqrt`).
Copy r draws exactly the standard normals a single run of the same seed draws (one ``(K, D)`` draw,
shared by the copies), so a stacked fit equals R single runs up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from bdl_bench.curvature.per_example import LinearLayout
from bdl_bench.likelihoods import Bernoulli, Categorical, Likelihood
from bdl_bench.methods._slang_stacked import StackedFactors, _assemble, gradient_sum, stacked_factors
from bdl_bench.methods.base import NonFiniteLossError


def squared_gradient_sum(factors: StackedFactors, layout: LinearLayout) -> Tensor:
    r""":math:`\sum_p g_p\circ g_p` of every copy, ``(R, D)``: per layer :math:`(\Delta^{\circ2})^\top A^{\circ2}`
    (no per-example gradient is formed)."""
    parts = []
    for layer, (a, d) in enumerate(zip(factors.inputs, factors.output_grads)):
        d2 = d.square()
        if layer == 0 and factors.first_input_shared:  # sum over the samples first
            d2 = d2.view(d.shape[0], factors.losses.shape[1], -1, d.shape[-1]).sum(1)
        parts.append((d2.mT @ a.square(), d2.sum(1)))
    return _assemble(layout, parts, factors.output_grads[0], ())


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
    r""":math:`\sum_pg_pg_p^	op` of every copy, ``(R, D, D)``. For one linear layer with one output on a shared
    input (logistic regression), :math:`g_{ki} = \delta_{ki}	ilde x_i`, so the sum is
    :math:`\sum_i(\sum_k\delta_{ki}^2)	ilde x_i	ilde x_i^	op`: M columns instead of S·M."""
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


def stacked_terms(
    model: nn.Sequential,
    layout: LinearLayout,
    likelihoods: Sequence[Likelihood],
    thetas: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    hessian: bool,
    full: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per copy: mean NLL ``(R,)``, Σ g ``(R, D)`` and Σ H ``(R, D, D)`` or its diagonal ``(R, D)``, over the K
    samples ``thetas`` ``(R, K, D)`` and the M examples ``x`` ``(R, M, in)``, ``y`` ``(R, M)``."""
    from bdl_bench.methods.vogn import _PseudoLoss, output_hessian_sqrt

    factors = stacked_factors(model, layout, thetas, x, y, likelihoods, share_first_input=True)
    n_copies, n_samples = thetas.shape[:2]
    if hessian:
        outputs = factors.outputs.reshape(n_copies, -1, factors.outputs.shape[-1])  # (R, P, out), p = (k, i)
        targets = y.repeat(1, n_samples)  # (R, P)
        if isinstance(likelihoods[0], Bernoulli | Categorical):  # no per-copy parameter: all copies in one call
            flat = output_hessian_sqrt(likelihoods[0], outputs.flatten(0, 1), targets.flatten())
            roots = flat.view(n_copies, -1, *flat.shape[1:])  # (R, P, C, out)
        else:
            roots = torch.stack([output_hessian_sqrt(lik, f, t) for lik, f, t in zip(likelihoods, outputs, targets)])
        pieces = []
        for c in range(roots.shape[2]):
            # one pseudo-loss for every copy: stacked_nll applies the first copy's likelihood to all rows
            pseudo = _PseudoLoss(roots[:, :, c].reshape(-1, roots.shape[-1]))
            pieces.append(stacked_factors(model, layout, thetas, x, y, [pseudo] * n_copies, share_first_input=True))
    else:
        pieces = [factors]
    if full:
        curv = sum(gram(piece, layout) for piece in pieces)
    else:
        curv = sum(squared_gradient_sum(piece, layout) for piece in pieces)
    return factors.losses.mean(dim=(1, 2)), gradient_sum(factors, layout), curv  # type: ignore[return-value]


def cholesky_or_raise(precision: Tensor, step: int) -> Tensor:
    """Batched Cholesky factors of ``(R, D, D)`` precisions; a copy that is not positive definite stops the run."""
    chol, info = torch.linalg.cholesky_ex(precision)
    bad = info.nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        raise NonFiniteLossError(
            f"method 'vogn': precision of stacked copy {r} is not positive definite after step {step} "
            f"(leading minor {int(info[r])}) — lower beta or check the data"
        )
    return chol


def first_bad_copy(*tensors: Tensor) -> int | None:
    """The first copy (leading index) where any of ``tensors`` is not finite, or ``None``."""
    ok = torch.ones(tensors[0].shape[0], dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        ok &= torch.isfinite(t).flatten(1).all(1)
    return None if bool(ok.all()) else int((~ok).nonzero()[0, 0])

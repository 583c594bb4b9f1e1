"""ELRG's kernels against their plain-autograd twins (float64): Lemma 2's KL against the dense covariance,
Lemma 1's layer sample against the plain expression."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.kernels.elrg_kl import elrg_kl, elrg_kl_reference
from bdl_bench.kernels.elrg_terms import LowRankLocalLinear, low_rank_local_linear_reference

DT = torch.float64


@pytest.mark.parametrize("diag_kind", ["vector", "constant"])
@pytest.mark.parametrize("prior_kind", ["vector", "constant"])
def test_elrg_kl_matches_its_reference(diag_kind: str, prior_kind: str) -> None:
    """Value and gradients of the matrix-determinant-lemma KL against the dense covariance's."""
    g = torch.Generator().manual_seed(4)
    dim, rank, alpha = 7, 3, 1 / 3
    mean = torch.randn(dim, generator=g, dtype=DT)
    factor = torch.randn(rank, dim, generator=g, dtype=DT)
    diag = torch.rand(dim, generator=g, dtype=DT) + 0.2 if diag_kind == "vector" else 0.3
    lam = torch.rand(dim, generator=g, dtype=DT) + 0.5 if prior_kind == "vector" else 1.7
    results = []
    for fn in (elrg_kl, elrg_kl_reference):
        leaves = [t.clone().requires_grad_(True) for t in (mean, factor)]
        d = diag.clone().requires_grad_(True) if isinstance(diag, torch.Tensor) else diag
        value = fn(leaves[0], leaves[1], d, lam, alpha)
        wrt = leaves + ([d] if isinstance(d, torch.Tensor) else [])
        results.append([value, *torch.autograd.grad(value, wrt)])
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("learn_diag", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_low_rank_local_linear_matches_autograd_and_writes_into_the_buffers(learn_diag: bool, bias: bool) -> None:
    """The hand-written backward of Lemma 1's dense layer against autograd of the plain expression, with a
    leading sample dimension and (without a bias) a clamped, zero variance."""
    g = torch.Generator().manual_seed(3)
    rank, n_in, n_out, alpha = 3, 4, 5, 1 / 3
    a = torch.randn(2, 6, n_in, generator=g, dtype=DT)
    a[0, 1] = 0.0  # without a bias this output's variance is 0: clamped, no gradient through it
    params = {
        "w_mean": torch.randn(n_out, n_in, generator=g, dtype=DT),
        "b_mean": torch.randn(n_out, generator=g, dtype=DT) if bias else None,
        "v_weight": torch.randn(rank, n_out, n_in, generator=g, dtype=DT),
        "v_bias": torch.randn(rank, n_out, generator=g, dtype=DT) if bias else None,
        "w_var": torch.rand(n_out, n_in, generator=g, dtype=DT) + 0.1 if learn_diag else None,
        "b_var": torch.rand(n_out, generator=g, dtype=DT) + 0.1 if learn_diag and bias else None,
    }
    const_var = None if learn_diag else 0.3
    eps_k = torch.randn(2, 6, 1, rank, generator=g, dtype=DT)
    eps, upstream = torch.randn(2, 6, n_out, generator=g, dtype=DT), torch.randn(2, 6, n_out, generator=g, dtype=DT)

    def grads(fused: bool, into: tuple | None = None) -> list[torch.Tensor | None]:
        leaves = {k: None if t is None else t.clone().requires_grad_(True) for k, t in params.items()}
        x = a.clone().requires_grad_(True)
        if fused:
            temps = (torch.empty(12, rank * n_out, dtype=DT), torch.empty(12, rank * n_out, dtype=DT))
            coef = math.sqrt(alpha) * eps_k
            out = LowRankLocalLinear.apply(x, *leaves.values(), coef, eps, const_var, into or (None,) * 6, temps)
        else:
            out = low_rank_local_linear_reference(x, *leaves.values(), const_var, eps_k, eps, alpha)
        (out * upstream).sum().backward()
        return [out.detach(), x.grad, *(None if t is None else t.grad for t in leaves.values())]

    plain = grads(False)
    for fused_grad, plain_grad in zip(grads(True), plain, strict=True):
        assert_close(fused_grad, plain_grad)
    into = tuple(None if t is None else torch.full_like(t, float("nan")) for t in params.values())
    fused = grads(True, into)
    for buffer, grad in zip(into, fused[2:], strict=True):  # the weight gradients were written into the buffers
        if buffer is not None:
            assert_close(buffer, grad)
    for fused_grad, plain_grad in zip(fused, plain, strict=True):
        assert_close(fused_grad, plain_grad)

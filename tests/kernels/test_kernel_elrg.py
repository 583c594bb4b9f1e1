"""ELRG's Lemma 1 layer kernel against its plain-autograd twin (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.kernels.elrg_terms import LowRankLocalLinear, low_rank_local_linear_reference

DT = torch.float64


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

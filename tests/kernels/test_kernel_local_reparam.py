"""The dense layers' locally reparameterised kernels against their plain-autograd twin (float64)."""

from __future__ import annotations

import pytest
import torch
from _kernel_references import local_linear_reference
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.kernels.local_reparam import StackedLocalLinear, local_linear


@pytest.mark.parametrize("bias", [True, False])
def test_local_linear_matches_its_reference(bias: bool) -> None:
    """One copy, with a leading sample dimension, a zero input row (no bias: a clamped variance)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    a[0, 1] = 0.0
    params = [
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.randn(3, generator=g, dtype=torch.float64) if bias else None,
        torch.rand(3, 4, generator=g, dtype=torch.float64),
        torch.rand(3, generator=g, dtype=torch.float64) + 0.1 if bias else None,
    ]
    eps, upstream = (
        torch.randn(2, 5, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 5, 3, generator=g, dtype=torch.float64),
    )
    results = []
    for fn in (local_linear, local_linear_reference):
        leaves = [a.clone().requires_grad_(True)] + [
            None if t is None else t.clone().requires_grad_(True) for t in params
        ]
        out = fn(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], eps)
        present = [t for t in leaves if t is not None]
        results.append([out, *torch.autograd.grad(out, present, upstream)])
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("n_samples", [1, 3])
@pytest.mark.parametrize("bias", ["none", "zero_var", "positive_var"])
def test_stacked_local_linear_matches_autograd_of_the_plain_expression(n_samples: int, bias: str, n_out: int) -> None:
    """The stacked layer's hand-written backward, with an input shared by S samples (S = 3: its products
    taken once per example) or not, and with the variance clamp needed (no bias, or a bias variance of 0
    with all-zero input rows) or skipped (a positive bias variance), for one output (broadcast products) and
    several, against autograd of
    ``a mu^T + b + sqrt(max(a^2 var^T + b_var, tiny)) eps`` on the inputs repeated S times (float64)."""
    gen = torch.Generator().manual_seed(3)
    r, m, n_in = 2, 5, 4

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    a = rand(r, m, n_in)
    a[:, 0] = 0.0  # rows whose variance is the bias variance alone
    w_mean, w_var = rand(r, n_out, n_in), rand(r, n_out, n_in).square()
    b_mean = None if bias == "none" else rand(r, n_out)
    b_var = {
        "none": None,
        "zero_var": torch.zeros(r, n_out, dtype=torch.float64),
        "positive_var": rand(r, n_out).square(),
    }[bias]
    eps, upstream = rand(n_samples * m, n_out), rand(r, n_samples * m, n_out)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (a, w_mean, b_mean, w_var, b_var)]
    out = StackedLocalLinear.apply(*leaves, eps)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], upstream)

    ref_leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (a, w_mean, b_mean, w_var, b_var)]
    ra, rwm, rbm, rwv, rbv = ref_leaves
    rows = ra.unsqueeze(1).expand(r, n_samples, m, n_in).reshape(r, n_samples * m, n_in)
    ref = local_linear_reference(rows, rwm, rbm, rwv, rbv, eps)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_leaves if t is not None], upstream)
    assert_close(out, ref)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want)

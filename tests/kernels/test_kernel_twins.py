"""The diagonal-Gaussian kernels against their plain-autograd twins (float64): value and gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _kernel_references import (
    diag_kl_reference,
    mean_field_reference,
    mean_field_variance_and_kl,
    prior_quadratic_reference,
)
from torch.testing import assert_close

from bdl_bench.kernels.diag_vi import diag_kl, prior_quadratic

DT = torch.float64


def _value_and_grads(fn: Callable, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` of fresh leaves of ``tensors`` (one output or several) and the leaves' gradients of a fixed
    random linear functional of every output."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    g = torch.Generator().manual_seed(11)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    return [*(o.detach() for o in outs), *torch.autograd.grad(loss, leaves)]


def _assert_twins(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def _data(n: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(n, generator=g, dtype=DT)
    std = torch.rand(n, generator=g, dtype=DT) + 0.05
    lam = torch.rand(n, generator=g, dtype=DT) + 0.5
    return mean, std, lam


@pytest.mark.parametrize("shared_prior", [True, False])
def test_prior_quadratic_matches_its_reference(shared_prior: bool) -> None:
    mean, _, lam = _data()
    prior = 1.3 if shared_prior else lam
    got = _value_and_grads(lambda m: prior_quadratic(m, prior), mean)
    _assert_twins(got, _value_and_grads(lambda m: prior_quadratic_reference(m, prior), mean))


@pytest.mark.parametrize("shared_prior", [True, False])
def test_diag_kl_matches_its_reference(shared_prior: bool) -> None:
    """A shared precision as one number, or one per coordinate."""
    _, std, lam = _data()
    prior = 1.3 if shared_prior else lam
    got = _value_and_grads(lambda s: diag_kl(s, prior), std)
    _assert_twins(got, _value_and_grads(lambda s: diag_kl_reference(s, prior), std))


@pytest.mark.parametrize("rho_shift", [-3.0, 25.0])
def test_mean_field_terms_match_their_reference(rho_shift: float) -> None:
    """sigma^2 and the KL of GMFVI's fused terms, below and above softplus's threshold."""
    mean, std, lam = _data()
    rho = torch.log(std) + rho_shift
    got = _value_and_grads(lambda m, r: mean_field_variance_and_kl(m, r, lam), mean, rho)
    _assert_twins(got, _value_and_grads(lambda m, r: mean_field_reference(m, r, lam), mean, rho))

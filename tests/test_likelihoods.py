"""Likelihoods' Hessian square roots against their slow twin, the dense autograd Hessian of the NLL."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood

F64 = torch.float64


class _Opaque(Likelihood):
    """A likelihood's NLL without its closed forms: takes :meth:`Likelihood.hessian_sqrt`'s generic path."""

    def __init__(self, inner: Likelihood) -> None:
        self.inner = inner

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        return self.inner.nll(f, y)


def _case(kind: str, generator: torch.Generator) -> tuple[Likelihood, Tensor, Tensor]:
    """A likelihood, outputs ``(7, out)`` (some far in the tails) and targets."""
    out = 4 if kind == "categorical" else 1
    f = 3.0 * torch.randn(7, out, generator=generator, dtype=F64)
    if kind == "bernoulli":
        return Bernoulli(), f, (torch.rand(7, generator=generator) < 0.5).to(F64)
    if kind == "gaussian":
        return Gaussian(3.0), f, torch.randn(7, generator=generator, dtype=F64)
    return Categorical(), f, torch.randint(0, 4, (7,), generator=generator)


def _dense_hessian(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    """∂²[−log p(y_i | f_i)]/∂f_i² of each example by autograd, one at a time: ``(N, out, out)``."""
    return torch.stack(
        [
            torch.autograd.functional.hessian(lambda f_i, i=i: likelihood.nll(f_i[None], y[i : i + 1]).sum(), f[i])
            for i in range(f.shape[0])
        ]
    )


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian", "categorical"])
def test_hessian_sqrt_factors_the_dense_autograd_hessian(kind: str, generator: torch.Generator) -> None:
    likelihood, f, y = _case(kind, generator)
    dense = _dense_hessian(likelihood, f, y)
    for lik in (likelihood, _Opaque(likelihood)):  # the closed form and the generic default
        roots = lik.hessian_sqrt(f, y)  # (C, N, out)
        assert roots.shape[1:] == f.shape
        assert_close(torch.einsum("cni,cnj->nij", roots, roots), dense)
    n_factors = 4 if kind == "categorical" else 1
    assert likelihood.hessian_sqrt(f, y).shape[0] == n_factors


def test_the_generic_hessian_sqrt_drops_negative_curvature() -> None:
    """A non-convex NLL (here −f² per example): the negative eigenvalue gives a zero factor."""

    class Concave(Likelihood):
        def nll(self, f: Tensor, y: Tensor) -> Tensor:
            return -((f.squeeze(-1) - y) ** 2)

    f = torch.tensor([[0.5], [-1.0]], dtype=F64)
    assert torch.equal(Concave().hessian_sqrt(f, torch.zeros(2, dtype=F64)), torch.zeros(1, 2, 1, dtype=F64))


def test_parameter_free_likelihoods_compare_equal() -> None:
    """Stacked copies under equal likelihoods share one call (bdl_bench.methods.vogn._hessian_roots)."""
    assert Bernoulli() == Bernoulli() and Categorical() == Categorical() and Gaussian(2.0) == Gaussian(2.0)
    assert Gaussian(2.0) != Gaussian(0.5) and Bernoulli() != Categorical()

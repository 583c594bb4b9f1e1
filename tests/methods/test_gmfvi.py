"""GMFVI: the fused variance-and-KL function against the plain closed form and autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _vi_helpers import make_method, make_problem
from torch.testing import assert_close

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods.bbb import kl_diag_to_prior, softplus_inverse
from bdl_bench.methods.gmfvi import diag_kl, mean_field_variance_and_kl


def _random(seed: int, n: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    mean = torch.randn(n, generator=g, dtype=dt)
    rho = torch.randn(n, generator=g, dtype=dt) - 1
    lam = torch.rand(n, generator=g, dtype=dt) * 3 + 0.1
    return mean, rho, lam


@pytest.mark.parametrize("use_var", [True, False])
def test_fused_variance_and_kl_match_autograd_of_the_closed_form(use_var: bool) -> None:
    mean, rho, lam = _random(0)
    weights = torch.randn(9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def objective(fused: bool) -> tuple[torch.Tensor, ...]:
        m, r = mean.clone().requires_grad_(True), rho.clone().requires_grad_(True)
        if fused:
            var, kl = mean_field_variance_and_kl(m, r, lam)
        else:
            std = F.softplus(r)
            var, kl = std**2, kl_diag_to_prior(m, std, lam)
        total = 0.7 * kl + (weights * var).sum() if use_var else 0.7 * kl
        total.backward()
        return var.detach(), kl.detach(), m.grad, r.grad

    for fused_value, plain_value in zip(objective(True), objective(False)):
        assert_close(fused_value, plain_value)


def test_fused_gradient_passes_gradcheck() -> None:
    mean, rho, lam = _random(2, n=5)
    m, r = mean.requires_grad_(True), rho.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: mean_field_variance_and_kl(a, b, lam), (m, r))
    std = F.softplus(rho.detach()).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, s: diag_kl(a, s, lam.view(5)), (m, std))
    assert_close(diag_kl(mean, std, lam), kl_diag_to_prior(mean, std, lam))
    two = torch.tensor(2.0, dtype=torch.float64)  # a scalar precision broadcasts
    assert_close(diag_kl(mean, std, two), kl_diag_to_prior(mean, std, 2.0 * torch.ones_like(lam)))


def test_starts_at_init_std_and_reports_a_diagonal_posterior() -> None:
    problem = make_problem(1, Gaussian(noise_precision=100.0), seed=0)
    method = make_method("gmfvi", init_std=0.05)
    method.setup(problem)
    assert_close(method.rho, softplus_inverse(torch.full_like(method.rho, 0.05)))
    q = method.posterior()
    assert isinstance(q, DiagGaussian)
    assert_close(q.mean, torch.nn.utils.parameters_to_vector(problem.model.parameters()).detach())
    assert_close(q.prec_diag, torch.full_like(q.mean, 0.05**-2))
    assert_close(method.kl_to_prior(), kl_diag_to_prior(q.mean, q.variance().sqrt(), problem.prior_precision))
    assert [s.shape for s in method.weight_stds()] == [(24, 1), (24, 24), (1, 24)]
    assert method.n_variational_params() == 2 * q.dim

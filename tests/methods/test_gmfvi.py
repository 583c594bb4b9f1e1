"""GMFVI: the fused KL, the hand-written dense layer and a whole training step against autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _kernel_references import mean_field_variance_and_kl
from _vi_helpers import make_method, make_problem, plain_local_outputs, weight_stds
from torch.testing import assert_close

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.kernels.diag_vi import diag_kl, prior_quadratic
from bdl_bench.kernels.local_reparam import local_linear
from bdl_bench.kernels.mean_field import MeanFieldScratch, mean_field_terms
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods._diag_vi import (
    kl_diag_to_prior,
    softplus_inverse,
    sqrt_or_tiny,
    sum_log,
    sum_log2,
    uniform_value,
)


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
    assert torch.autograd.gradcheck(lambda s: diag_kl(s, lam.view(5)), (std,))
    assert_close(diag_kl(std, lam) + prior_quadratic(mean, lam), kl_diag_to_prior(mean, std, lam))
    two = torch.tensor(2.0, dtype=torch.float64)  # a scalar precision broadcasts
    full_kl = diag_kl(std, two) + prior_quadratic(mean, two)
    assert_close(full_kl, kl_diag_to_prior(mean, std, 2.0 * torch.ones_like(lam)))


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
    assert [s.shape for s in weight_stds(method)] == [(24, 1), (24, 24), (1, 24)]
    assert method.n_variational_params() == 2 * q.dim


def test_local_linear_matches_autograd_and_writes_into_the_buffers() -> None:
    """The hand-written backward of the dense local reparameterisation against autograd of the plain
    expression, with a leading sample dimension and a clamped (zero) variance."""
    g = torch.Generator().manual_seed(3)
    dt = torch.float64
    a = torch.randn(2, 5, 4, generator=g, dtype=dt)
    a[0, 1] = 0.0  # without a bias variance this output's variance is 0: clamped, no gradient through it
    w_mean, b_mean = torch.randn(3, 4, generator=g, dtype=dt), torch.randn(3, generator=g, dtype=dt)
    w_var = torch.rand(3, 4, generator=g, dtype=dt) + 0.1
    eps, upstream = torch.randn(2, 5, 3, generator=g, dtype=dt), torch.randn(2, 5, 3, generator=g, dtype=dt)

    def grads(fused: bool, into: tuple = (None, None, None, None)) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (a, w_mean, b_mean, w_var)]
        x, wm, bm, wv = leaves
        if fused:
            out = local_linear(x, wm, bm, wv, None, eps, into)
        else:
            out = F.linear(x, wm, bm) + sqrt_or_tiny(F.linear(x * x, wv)) * eps
        (out * upstream).sum().backward()
        return [out.detach(), *(t.grad for t in leaves)]

    for fused, plain in zip(grads(True), grads(False)):
        assert_close(fused, plain)
    into = (torch.empty(3, 4, dtype=dt), torch.empty(3, dtype=dt), torch.empty(3, 4, dtype=dt), None)
    fused = grads(True, into)
    for buffer, grad in zip(into[:3], fused[2:5]):  # the weight gradients were written into the buffers
        assert_close(buffer, grad)
    for fused_grad, plain_grad in zip(fused, grads(False)):
        assert_close(fused_grad, plain_grad)


@pytest.mark.parametrize("uniform_prior", [True, False])
def test_mean_field_terms_match_autograd_and_reuse_their_buffers(uniform_prior: bool) -> None:
    mean, rho, lam = _random(4, n=10)
    if uniform_prior:
        lam = torch.full_like(lam, 2.5)
    shapes = [torch.Size([2, 3]), torch.Size([4])]
    weights = torch.randn(10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    scratch = MeanFieldScratch.like(mean)

    def objective(m: torch.Tensor, r: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:
            prior = uniform_value(lam)
            terms = mean_field_terms(m, r, prior, float(torch.log(lam).sum()), shapes, scratch)
            assert isinstance(prior, float) == uniform_prior
            mean_flat = torch.cat([p.flatten() for p in terms.mean_parts])
            var_flat = torch.cat([p.flatten() for p in terms.var_parts])
            kl = terms.kl
        else:
            mean_flat, var_flat = m, F.softplus(r) ** 2
            kl = kl_diag_to_prior(m, F.softplus(r), lam)
        return 0.3 * kl + (weights * var_flat).sum() + (weights.flip(0) * mean_flat**2).sum()

    m, r = mean.clone().requires_grad_(True), rho.clone().requires_grad_(True)
    objective(m, r, fused=True).backward()
    m0, r0 = mean.clone().requires_grad_(True), rho.clone().requires_grad_(True)
    objective(m0, r0, fused=False).backward()
    assert_close(m.grad, m0.grad)
    assert_close(r.grad, r0.grad)
    assert m.grad.data_ptr() == scratch.grad_mean.data_ptr()  # the buffer became .grad, no copy
    assert r.grad.data_ptr() == scratch.grad_rho.data_ptr()
    # a second backward without zeroing accumulates (into fresh buffers, not over .grad itself)
    objective(m, r, fused=True).backward()
    assert_close(m.grad, 2 * m0.grad)
    assert_close(r.grad, 2 * r0.grad)


@pytest.mark.parametrize("n_samples", [1, 2])
@pytest.mark.parametrize("init_std", [0.1, 1e-160])
def test_train_step_gradients_match_plain_autograd(n_samples: int, init_std: float) -> None:
    """A GMFVI step (fused KL, hand-written dense layers writing the gradients into the buffers) has the
    gradients of the plain objective: softplus, the closed-form KL and ``_diag_vi.local_reparam_linear``, with
    the same noise; also with variances below ``tiny`` (init_std 1e-160: the clamp of ``sqrt_or_tiny``)."""
    problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, dtype=torch.float64, n_data=40)
    method = make_method("gmfvi", init_std=init_std, n_train_mc_samples=n_samples, kl_annealing_steps=3)
    method.setup(problem)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    mean, rho = method.mean.detach().clone().requires_grad_(True), method.rho.detach().clone().requires_grad_(True)
    problem.generator.manual_seed(11)
    out = method.train_step(x, y)

    problem.generator.manual_seed(11)
    std = F.softplus(rho)
    h = plain_local_outputs(method, mean, std**2, x, n_samples)
    nll = torch.stack([problem.likelihood.nll(f, y) for f in h]).mean()
    lam = problem.prior_precision  # the closed form with log(sigma), finite where sigma^2 underflows
    kl = (0.5 * (lam * (std**2 + mean**2) - 1 - torch.log(lam)).sum() - torch.log(std).sum()) / problem.n_data
    (nll + out["kl_weight"] * kl).backward()
    nll, kl = nll.detach(), kl.detach()
    assert out["kl_weight"] == pytest.approx(1 / 3)
    assert out["nll"] == pytest.approx(nll.item()) and out["kl"] == pytest.approx(kl.item())
    assert_close(method.mean.grad, mean.grad)
    assert_close(method.rho.grad, rho.grad)


def test_diag_kl_with_one_prior_precision_matches_autograd() -> None:
    mean, rho, _ = _random(6, n=6)
    std = F.softplus(rho)
    m, s = mean.view(2, 3).requires_grad_(True), std.view(2, 3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda b: diag_kl(b, 1.7), (s,))
    assert_close(diag_kl(s, 1.7) + prior_quadratic(m, 1.7), kl_diag_to_prior(mean, std, torch.full_like(mean, 1.7)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_field_gradients_over_a_wide_range_of_rho(dtype: torch.dtype) -> None:
    """The fused backward ((2 dL/dvar + g lam) var - g) * sigmoid / sigma against autograd of the plain
    softplus and the KL with log(sigma), for rho from -60 to 15 (sigma from 1e-26 to 15)."""
    g = torch.Generator().manual_seed(12)
    rho = torch.linspace(-60.0, 15.0, 301, dtype=dtype)
    mean = torch.randn(301, generator=g, dtype=dtype)
    weights = torch.randn(301, generator=g, dtype=dtype)
    shapes = [torch.Size([301])]

    def grads(fused: bool) -> tuple[torch.Tensor, ...]:
        m, r = mean.clone().requires_grad_(True), rho.clone().requires_grad_(True)
        if fused:
            t = mean_field_terms(m, r, 1.5, 301 * math.log(1.5), shapes, MeanFieldScratch.like(m))
            var, kl = t.var_parts[0], t.kl
        else:
            std = F.softplus(r)
            var = std**2
            kl = 0.5 * (1.5 * (var + m**2) - 1 - math.log(1.5)).sum() - torch.log(std).sum()
        (0.3 * kl + (weights * var).sum()).backward()
        return kl.detach(), m.grad, r.grad

    info = torch.finfo(dtype)
    for fused, plain in zip(grads(True), grads(False)):
        assert_close(fused, plain, rtol=64 * info.eps, atol=info.tiny)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [3, 37, 1000, 4099])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e-12, 1e12])
def test_sum_of_logarithms_of_products(dtype: torch.dtype, n: int, scale: float) -> None:
    """sum_log2 (logarithms of products of up to 17 entries, as the bounds allow) against the plain sum;
    entries spread over two decades around ``scale`` (1e±12 leave the products of float32 no room)."""
    x = (torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 2 - 1).exp2().mul(
        10 ** torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ) * scale
    x = x.to(dtype)
    expected = torch.log2(x.double()).sum()
    got = sum_log2(x, torch.empty_like(x), float(x.min()), float(x.max()))
    assert got.dtype == dtype
    assert_close(got.double(), expected, rtol=0, atol=float(n * 8 * torch.finfo(dtype).eps * 40))
    assert_close(sum_log(x, torch.empty_like(x)).double(), expected * math.log(2.0), rtol=0, atol=n * 3e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sigmoid_path_of_softplus_matches_torch(dtype: torch.dtype) -> None:
    """Where every rho is in [-80, 1] sigma comes from torch.sigmoid (-log1p(-sigmoid)); sigma^2 agrees with
    F.softplus(rho)^2 to a few ulp (a subnormal sigma^2 to its spacing)."""
    rho = torch.linspace(-80.0, 1.0, 200_001, dtype=dtype)
    mean = torch.zeros_like(rho)
    var, _ = mean_field_variance_and_kl(mean, rho, torch.ones_like(rho))
    info = torch.finfo(dtype)
    assert_close(var, F.softplus(rho) ** 2, rtol=8 * info.eps, atol=info.tiny)  # var may be subnormal

"""ELRG-VI: Lemma 2's KL against the dense Gaussian KL, marginals, bad ranks."""

from __future__ import annotations

import pytest
import torch
from _vi_helpers import make_method, make_problem
from torch.testing import assert_close

from bdl_bench.gaussians import DiagGaussian, FullGaussian, kl
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods.elrg import elrg_kl

DT = torch.float64


def _dense_kl(mean, factor, diag, lam, alpha):  # noqa: ANN001, ANN202
    cov = alpha * factor.T @ factor + torch.diag(diag)
    return kl(FullGaussian.from_covariance(mean, cov), DiagGaussian(torch.zeros_like(mean), lam))


@pytest.mark.parametrize("diag_kind", ["vector", "constant"])
@pytest.mark.parametrize("prior_kind", ["vector", "constant"])
def test_lemma_2_kl_matches_the_dense_kl(diag_kind: str, prior_kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    dim, rank, alpha = 7, 3, 1 / 3
    mean = torch.randn(dim, generator=g, dtype=DT)
    factor = torch.randn(rank, dim, generator=g, dtype=DT)
    diag = torch.rand(dim, generator=g, dtype=DT) + 0.05 if diag_kind == "vector" else 0.3
    lam = torch.rand(dim, generator=g, dtype=DT) * 3 + 0.1 if prior_kind == "vector" else 2.0
    diag_t = diag if isinstance(diag, torch.Tensor) else torch.full((dim,), diag, dtype=DT)
    lam_t = lam if isinstance(lam, torch.Tensor) else torch.full((dim,), lam, dtype=DT)
    assert_close(elrg_kl(mean, factor, diag, lam, alpha), _dense_kl(mean, factor, diag_t, lam_t, alpha))


@pytest.mark.parametrize("diag_kind", ["vector", "constant"])
@pytest.mark.parametrize("prior_kind", ["vector", "constant"])
def test_lemma_2_hand_written_gradient_passes_gradcheck(diag_kind: str, prior_kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    dim, rank = 6, 2
    mean = torch.randn(dim, generator=g, dtype=DT, requires_grad=True)
    factor = torch.randn(rank, dim, generator=g, dtype=DT, requires_grad=True)
    lam = torch.rand(dim, generator=g, dtype=DT) + 0.5 if prior_kind == "vector" else 1.5
    if diag_kind == "vector":
        diag = (torch.rand(dim, generator=g, dtype=DT) + 0.2).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda m, f, c: elrg_kl(m, f, c, lam, 0.5), (mean, factor, diag))
    else:
        assert torch.autograd.gradcheck(lambda m, f: elrg_kl(m, f, 0.3, lam, 0.5), (mean, factor))


@pytest.mark.parametrize("learn_diag", [False, True])
def test_method_kl_and_marginals_match_the_dense_block_diagonal_gaussian(learn_diag: bool) -> None:
    model_cfg = {"name": "mlp", "hidden": [4], "activation": "tanh"}
    problem = make_problem(2, Gaussian(noise_precision=1.0), seed=0, model_cfg=model_cfg, dtype=DT)
    problem.prior_precision[-3:] = 5.0  # not constant on the last layer: the per-parameter path
    method = make_method("elrg", rank=2, learn_diag=learn_diag, init_std=0.2)
    method.setup(problem)
    with torch.no_grad():
        for t in method.variational.values():
            t.add_(0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=DT))
    total, variances = 0.0, []
    for layer, start in zip(method.layers, method.layer_offsets):
        mean = method.mean.detach().narrow(0, start, layer.n_params)
        factor = method.layer_cov_factor(layer).detach()
        diag = method.layer_cov_diag(layer)
        diag = diag.detach() if isinstance(diag, torch.Tensor) else torch.full_like(mean, diag)
        lam = problem.prior_precision.narrow(0, start, layer.n_params)
        total = total + _dense_kl(mean, factor, diag, lam, 0.5)
        variances.append(torch.diagonal(0.5 * factor.T @ factor) + diag)
    assert_close(method.kl_to_prior(), total)
    assert_close(method.marginal_std(), torch.cat(variances).sqrt())
    assert method.posterior() is None  # a covariance-form low-rank Gaussian has no class in bdl_bench.gaussians


def test_constant_diagonal_is_not_a_parameter() -> None:
    problem = make_problem(2, Gaussian(noise_precision=1.0), seed=0)
    fixed, learned = make_method("elrg", rank=3, learn_diag=False), make_method("elrg", rank=3, learn_diag=True)
    fixed.setup(problem)
    learned.setup(problem)
    assert "rho" not in fixed.variational and learned.variational["rho"].shape == fixed.mean.shape
    n_layer_params = [layer.n_params for layer in fixed.layers]
    assert fixed.n_variational_params() == sum(n_layer_params) * (1 + 3)
    assert learned.n_variational_params() == sum(n_layer_params) * (2 + 3)
    assert fixed.variational["v_weight2"].shape == (3, 24, 24)
    assert fixed.variational["v_bias2"].shape == (3, 24)


@pytest.mark.parametrize(("rank", "message"), [(0, "rank must be an integer >= 1"), (2.5, "rank must be")])
def test_bad_rank_raises_at_construction(rank: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_method("elrg", rank=rank)
    with pytest.raises(ValueError, match="learn_diag"):
        make_method("elrg", learn_diag="yes")


def test_rank_above_a_layer_size_raises_at_setup() -> None:
    model_cfg = {"name": "logreg", "bias": True}
    problem = make_problem(3, Gaussian(noise_precision=1.0), seed=0, model_cfg=model_cfg)  # D = 4
    with pytest.raises(ValueError, match=r"rank=5 exceeds the 4 parameters of linear layer 1 \(3→1\)"):
        make_method("elrg", rank=5).setup(problem)
    make_method("elrg", rank=4).setup(problem)

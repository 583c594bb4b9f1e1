"""ELRG-VI: Lemma 2's KL against the dense Gaussian KL, marginals, bad ranks, and the fused training step
(hand-written backwards into reused buffers) against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _vi_helpers import make_method, make_problem
from torch.testing import assert_close

from bdl_bench.gaussians import DiagGaussian, FullGaussian, kl
from bdl_bench.kernels.elrg_kl import elrg_kl_blocks
from bdl_bench.kernels.elrg_terms import low_rank_local_linear_reference
from bdl_bench.likelihoods import Gaussian

DT = torch.float64


def _dense_kl(mean, factor, diag, lam, alpha):  # noqa: ANN001, ANN202
    precision = torch.linalg.inv(alpha * factor.T @ factor + torch.diag(diag))
    return kl(FullGaussian(mean, (precision + precision.mT) / 2), DiagGaussian(torch.zeros_like(mean), lam))


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
    assert_close(elrg_kl_blocks([(mean, factor, diag, lam)], alpha), _dense_kl(mean, factor, diag_t, lam_t, alpha))


@pytest.mark.parametrize("learn_diag", [False, True])
def test_method_kl_matches_the_dense_block_diagonal_gaussian(learn_diag: bool) -> None:
    model_cfg = {"name": "mlp", "hidden": [4], "activation": "tanh"}
    problem = make_problem(2, Gaussian(noise_precision=1.0), seed=0, model_cfg=model_cfg, dtype=DT)
    problem.prior_precision[-3:] = 5.0  # not constant on the last layer: the per-parameter path
    method = make_method("elrg", rank=2, learn_diag=learn_diag, init_std=0.2)
    method.setup(problem)
    with torch.no_grad():
        for t in method.variational.values():
            t.add_(0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=DT))
    total = 0.0
    for layer in method.layers:
        start = layer.slices["weight"].start
        mean = method.mean.detach().narrow(0, start, layer.n_params)
        factor = method.layer_cov_factor(layer).detach()
        if learn_diag:
            diag = F.softplus(method.variational["rho"]).square().narrow(0, start, layer.n_params).detach()
        else:
            diag = torch.full_like(mean, method.init_std**2)
        lam = problem.prior_precision.narrow(0, start, layer.n_params)
        total = total + _dense_kl(mean, factor, diag, lam, 0.5)
    assert_close(method.kl_to_prior(), total)
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


@pytest.mark.parametrize(
    ("rank", "message"), [(0, r"method\.rank=0 is out of range: it must be an integer >= 1"), (2.5, "method.rank=2.5")]
)
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


def _plain_elrg_loss(method, x, y, leaves, seed):  # noqa: ANN001, ANN202
    """The annealed negative ELBO of a training step from scratch: Lemma 1 as the plain expression, the KL of
    every layer as the dense Gaussian KL, the noise drawn in the method's order from its generator reseeded."""
    problem = method.problem
    problem.generator.manual_seed(seed)
    mean = method.split_params(leaves["mean"])
    var = method.split_params(F.softplus(leaves["rho"]).square()) if "rho" in leaves else None
    n = method.n_train_mc_samples
    h = x.unsqueeze(0).expand(n, *x.shape)
    total_kl = 0.0
    for module in problem.model.children():
        layer = method._layer_of.get(module)
        if layer is None:
            h = module(h)
            continue
        w, b, i = layer.weight_param, layer.bias_param, layer.index
        v_weight, v_bias = leaves[f"v_weight{i}"], leaves.get(f"v_bias{i}")
        eps_k = torch.randn((*h.shape[:-1], 1, method.rank), generator=problem.generator, dtype=DT)
        eps = torch.randn((*h.shape[:-1], layer.out_features), generator=problem.generator, dtype=DT)
        w_var, b_var = (None, None) if var is None else (var[w], None if b is None else var[b])
        const_var = None if var is not None else method.init_std**2
        b_mean = None if b is None else mean[b]
        h = low_rank_local_linear_reference(
            h, mean[w], b_mean, v_weight, v_bias, w_var, b_var, const_var, eps_k, eps, method.alpha
        )
        start = layer.slices["weight"].start
        flat_mean = leaves["mean"].narrow(0, start, layer.n_params)
        factor = torch.cat([v_weight.flatten(1)] + ([] if v_bias is None else [v_bias]), dim=1)
        lam = problem.prior_precision.narrow(0, start, layer.n_params)
        if var is None:
            diag = torch.full_like(flat_mean, const_var)
        else:
            diag = F.softplus(leaves["rho"]).square().narrow(0, start, layer.n_params)
        total_kl = total_kl + _dense_kl(flat_mean, factor, diag, lam, method.alpha)
    nll = torch.stack([problem.likelihood.nll(f, y) for f in h]).mean()
    return nll, total_kl / problem.n_data


def _elrg_method(learn_diag: bool):  # noqa: ANN202
    model_cfg = {"name": "mlp", "hidden": [5, 4], "activation": "tanh"}
    problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, model_cfg=model_cfg, dtype=DT, n_data=40)
    problem.prior_precision[-3:] = 5.0  # not constant on the last layer's weight: the per-parameter prior path
    method = make_method("elrg", rank=2, learn_diag=learn_diag, init_std=0.1, kl_annealing_steps=3)
    method.setup(problem)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(7, 3, generator=g, dtype=DT), torch.randn(7, generator=g, dtype=DT)
    return method, problem, x, y


def _leaf_names(method) -> list[str]:  # noqa: ANN001
    return ["mean", *method.variational]


def _leaf(method, name: str) -> torch.Tensor:  # noqa: ANN001
    return method.mean if name == "mean" else method.variational[name]


@pytest.mark.parametrize("learn_diag", [False, True])
def test_train_step_gradients_match_plain_autograd(learn_diag: bool) -> None:
    """A fused ELRG step (two MC samples, annealed KL, a per-parameter prior on one layer) has the gradients
    and values of the plain objective, Lemma 1 and the dense-Gaussian KL differentiated by autograd."""
    method, problem, x, y = _elrg_method(learn_diag)
    leaves = {n: _leaf(method, n).detach().clone().requires_grad_(True) for n in _leaf_names(method)}
    problem.generator.manual_seed(11)
    out = method.train_step(x, y)
    nll, kl_term = _plain_elrg_loss(method, x, y, leaves, seed=11)
    (nll + out["kl_weight"] * kl_term).backward()
    assert out["kl_weight"] == pytest.approx(1 / 3)
    assert out["nll"] == pytest.approx(nll.item(), rel=1e-12) and out["kl"] == pytest.approx(kl_term.item(), rel=1e-12)
    for name, leaf in leaves.items():
        assert_close(_leaf(method, name).grad, leaf.grad, rtol=1e-10, atol=1e-12)
        if name != "mean":  # the gradient is the step's buffer itself (no copy)
            buffers = method._buffers
            buffer = buffers.grad_rho if name == "rho" else buffers.grad_factors[method._factor_names.index(name)]
            assert _leaf(method, name).grad.data_ptr() == buffer.data_ptr()
    assert method.mean.grad.data_ptr() == method._buffers.grad_mean.data_ptr()


@pytest.mark.parametrize("learn_diag", [False, True])
def test_a_second_backward_without_zeroing_accumulates(learn_diag: bool) -> None:
    """With ``.grad`` already one of the step's buffers, a second backward adds to it (into fresh buffers)."""
    method, problem, x, y = _elrg_method(learn_diag)

    def backward() -> None:
        problem.generator.manual_seed(5)
        terms = method._step_terms(with_kl=True)
        f = method._outputs_local(terms, x, method.n_train_mc_samples)
        loss = torch.stack([problem.likelihood.nll(f_s, y) for f_s in f]).mean() + terms.kl / problem.n_data
        loss.backward()

    backward()
    once = {n: _leaf(method, n).grad.clone() for n in _leaf_names(method)}
    backward()
    for name, grad in once.items():
        assert_close(_leaf(method, name).grad, 2 * grad)


@pytest.mark.parametrize("learn_diag", [False, True])
def test_fused_steps_follow_the_plain_formulation(learn_diag: bool) -> None:
    """Three whole training steps (Adam included) with the fused terms and layers, and with the plain ones
    (:meth:`_plain_terms`: elrg_kl_blocks and Lemma 1 as the plain expression), from one start and one seed."""
    fused, problem_f, x, y = _elrg_method(learn_diag)
    plain, problem_p, _, _ = _elrg_method(learn_diag)
    plain._fused_terms = lambda: plain._plain_terms(with_kl=True)
    problem_f.generator.manual_seed(21)
    problem_p.generator.manual_seed(21)
    for _ in range(3):
        out_f, out_p = fused.train_step(x, y), plain.train_step(x, y)
        assert {k: float(v) for k, v in out_f.items()} == pytest.approx(
            {k: float(v) for k, v in out_p.items()}, rel=1e-12
        )
    for name in _leaf_names(fused):
        assert_close(_leaf(fused, name), _leaf(plain, name), rtol=1e-12, atol=1e-14)

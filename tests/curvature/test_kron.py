"""Kronecker factors, EFB, DEF and the diagonal against exact GGN/Fisher matrices computed by autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _dense import ggn_by_autograd
from _nets import small_net
from torch import nn
from torch.func import grad, vmap
from torch.testing import assert_close

from bdl_bench.curvature.def_lowrank import diagonal_correction, kron_diag, sparsify
from bdl_bench.curvature.exact import exact_blocks, exact_matrix
from bdl_bench.curvature.kron import ChunkCache, diagonal, efb_eigenvalues, eigenbasis, flat_to_grid, kron_factors
from bdl_bench.curvature.pseudo_grads import block_index, iter_pseudo_grads, kron_layout, pseudo_grads, sample_labels
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.models.params import forward_with

LIKELIHOODS = {"gaussian": (Gaussian(2.5), 1), "bernoulli": (Bernoulli(), 1), "categorical": (Categorical(), 3)}
N_DATA = 9


def _setup(
    name: str, generator: torch.Generator, n: int = N_DATA, arch: str = "mlp"
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Likelihood]:
    likelihood, n_out = LIKELIHOODS[name]
    model = small_net(arch, n_out)
    theta = torch.randn(sum(p.numel() for p in model.parameters()), generator=generator, dtype=torch.float64)
    x = torch.randn(n, 3 if arch == "mlp" else 25, generator=generator, dtype=torch.float64)
    y = torch.randint(0, max(n_out, 2), (n,), generator=generator).double()
    return model, theta, x, y, likelihood


def _batches(model, theta, x, y, likelihood, **kw):
    return iter_pseudo_grads(model, theta, x, y, likelihood, batch_size=4, **kw)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("name", LIKELIHOODS)
def test_exact_matrix_blocks_and_diagonal_match_autograd_ggn(name: str, arch: str, generator: torch.Generator) -> None:
    model, theta, x, y, likelihood = _setup(name, generator, arch=arch)
    reference = ggn_by_autograd(model, theta, x, y, likelihood)
    assert_close(exact_matrix(_batches(model, theta, x, y, likelihood)), reference)
    assert_close(diagonal(_batches(model, theta, x, y, likelihood)), reference.diagonal())
    layout = kron_layout(model)
    for block, slot in zip(exact_blocks(_batches(model, theta, x, y, likelihood)), layout.slots):
        idx = block_index(slot)
        assert_close(block, reference[idx[:, None], idx[None, :]])


@pytest.mark.parametrize("name", LIKELIHOODS)
def test_kfac_is_exact_for_one_example(name: str, generator: torch.Generator) -> None:
    """With N = 1 the expectation of a Kronecker product is the product of expectations."""
    model, theta, x, y, likelihood = _setup(name, generator, n=1)
    reference = ggn_by_autograd(model, theta, x, y, likelihood)
    for factors in kron_factors(_batches(model, theta, x, y, likelihood)):
        idx = block_index(factors.slot)
        assert_close(factors.dense(), reference[idx[:, None], idx[None, :]])


@pytest.mark.parametrize("name", ["gaussian", "categorical"])
def test_kfac_factors_match_module_hooks(name: str, generator: torch.Generator) -> None:
    """A = mean of [a,1][a,1]^T and G = mean of sum_k delta delta^T, recorded by nn.Module hooks."""
    model, theta, x, y, likelihood = _setup(name, generator)
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    seen_inputs, seen_grads = {}, {}
    for i, m in enumerate(model):
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, inp, out, i=i: seen_inputs.__setitem__(i, inp[0].detach()))
            m.register_full_backward_hook(lambda mod, gin, gout, i=i: seen_grads.setdefault(i, []).append(gout[0]))
    f = model(x.requires_grad_(True))  # an input with grad keeps the full backward hooks quiet
    if name == "gaussian":
        cotangents = [torch.full_like(f, math.sqrt(likelihood.noise_precision))]
    else:
        p = torch.softmax(f.detach(), -1)
        cotangents = [p[:, k : k + 1].sqrt() * (torch.eye(3, dtype=f.dtype)[k] - p) for k in range(3)]
    for v in cotangents:
        f.backward(v, retain_graph=True)
    for factors in kron_factors(_batches(model, theta, x, y, likelihood)):
        i = factors.slot.module_index
        a = torch.cat([seen_inputs[i], torch.ones(N_DATA, 1, dtype=torch.float64)], 1)
        assert_close(factors.a_factor, a.mT @ a / N_DATA)
        assert_close(factors.g_factor, sum(g.mT @ g for g in seen_grads[i]) / N_DATA)


def test_conv_kfac_factors_are_kfc_of_unfolded_patches(generator: torch.Generator) -> None:
    """Conv layers: A = mean over examples of sum over positions of [patch,1][patch,1]^T (F.unfold of the
    recorded input), G = mean of (1/T) sum over positions of delta delta^T (recorded output gradients)."""
    model, theta, x, y, likelihood = _setup("categorical", generator, arch="cnn")
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    seen_inputs, seen_grads = {}, {}
    for i, m in enumerate(model):
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda mod, inp, out, i=i: seen_inputs.__setitem__(i, inp[0].detach()))
            m.register_full_backward_hook(lambda mod, gin, gout, i=i: seen_grads.setdefault(i, []).append(gout[0]))
    f = model(x.requires_grad_(True))
    p = torch.softmax(f.detach(), -1)
    for k in range(3):
        f.backward(p[:, k : k + 1].sqrt() * (torch.eye(3, dtype=f.dtype)[k] - p), retain_graph=True)
    checked = 0
    for factors in kron_factors(_batches(model, theta, x, y, likelihood)):
        i = factors.slot.module_index
        module = model[i]
        if not isinstance(module, nn.Conv2d):
            continue
        patches = F.unfold(seen_inputs[i], module.kernel_size, module.dilation, module.padding, module.stride).mT
        if module.bias is not None:
            patches = torch.cat([patches, torch.ones_like(patches[..., :1])], -1)
        patches = patches.reshape(-1, patches.shape[-1])
        assert_close(factors.a_factor, patches.mT @ patches / N_DATA)
        grads = [g.flatten(2).mT.reshape(-1, g.shape[1]) for g in seen_grads[i]]
        n_positions = seen_grads[i][0][0, 0].numel()
        assert_close(factors.g_factor, sum(g.mT @ g for g in grads) / (N_DATA * n_positions))
        checked += 1
    assert checked == 2


@pytest.mark.parametrize("name", LIKELIHOODS)
def test_sampled_label_fisher_matches_per_example_autograd(name: str, generator: torch.Generator) -> None:
    """For given sampled labels, the Fisher from pseudo-gradients is mean_{i,s} grad grad^T / S."""
    model, theta, x, y, likelihood = _setup(name, generator)
    f = forward_with(model, theta, x)
    labels = sample_labels(likelihood, f, 3, generator)  # (S, N)

    def loss(th, xi, yi):
        return likelihood.nll(forward_with(model, th, xi[None]), yi[None]).sum()

    per_example = torch.cat([vmap(grad(loss), in_dims=(None, 0, 0))(theta, x, lab) for lab in labels])  # (S N, D)
    expected = per_example.mT @ per_example / (3 * N_DATA)
    batch = pseudo_grads(model, theta, x, y, likelihood, kind="fisher", labels=labels)
    assert_close(exact_matrix([batch]), expected)
    assert_close(diagonal([batch]), expected.diagonal())


@pytest.mark.parametrize("name", ["gaussian", "bernoulli"])
def test_sampled_label_fisher_converges_to_the_ggn(name: str, generator: torch.Generator) -> None:
    model, theta, x, y, likelihood = _setup(name, generator)
    exact = ggn_by_autograd(model, theta, x, y, likelihood)
    mc = exact_matrix(_batches(model, theta, x, y, likelihood, kind="fisher", n_samples=3000, generator=generator))
    assert torch.linalg.norm(mc - exact) / torch.linalg.norm(exact) < 0.05


def _layers(name: str, generator: torch.Generator, arch: str = "mlp", cached: str | None = None):
    """Factors, eigenbases, EFB eigenvalues, the diagonal and the exact blocks; with ``cached`` (``all``,
    ``half``) the EFB pass runs over pass 1's chunks kept by a :class:`ChunkCache` (with ``half``, of half the
    bytes of all of them: the first chunk only, the rest recomputed)."""
    model, theta, x, y, likelihood = _setup(name, generator, arch=arch)
    if cached is None:
        factors = kron_factors(_batches(model, theta, x, y, likelihood))
        bases = eigenbasis(factors)
        eigs, diag = efb_eigenvalues(_batches(model, theta, x, y, likelihood), bases)
    else:
        probe = ChunkCache(2**30)
        for _ in probe.record(_batches(model, theta, x, y, likelihood)):
            pass
        cache = ChunkCache(probe.nbytes if cached == "all" else probe.nbytes // 2)
        factors = kron_factors(cache.record(_batches(model, theta, x, y, likelihood)))
        bases = eigenbasis(factors)
        rows = cache.n_cached_rows
        assert rows == (N_DATA if cached == "all" else 4)  # chunks of 4, 4, 1 rows
        eigs, diag = efb_eigenvalues(_batches(model, theta, x[rows:], y[rows:], likelihood), bases, cache=cache)
    blocks = exact_blocks(_batches(model, theta, x, y, likelihood))
    return factors, bases, eigs, diag, blocks


@pytest.mark.parametrize("cached", [None, "half", "all"])
@pytest.mark.parametrize("arch", ["mlp", "cnn", "cnn-t1"])
@pytest.mark.parametrize("name", LIKELIHOODS)
def test_efb_eigenvalues_minimise_frobenius_error_in_the_fixed_basis(
    name: str, arch: str, cached: str | None, generator: torch.Generator
) -> None:
    factors, bases, eigs, _, blocks = _layers(name, generator, arch, cached)
    for f, basis, lam, exact in zip(factors, bases, eigs, blocks):
        v = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
        assert_close(lam.reshape(-1), (v.mT @ exact @ v).diagonal())  # the least-squares optimum

        def error(values: torch.Tensor, exact: torch.Tensor = exact, v: torch.Tensor = v) -> torch.Tensor:
            return torch.linalg.norm(exact - v @ torch.diag(values) @ v.mT)

        best = error(lam.reshape(-1))
        for _ in range(5):
            assert (
                error(lam.reshape(-1) + 1e-3 * torch.randn(lam.numel(), generator=generator, dtype=torch.float64))
                > best
            )
        kfac = f.dense()
        assert_close(v @ torch.diag(torch.kron(basis.eigvals_out, basis.eigvals_in)) @ v.mT, kfac)
        assert best <= torch.linalg.norm(exact - kfac) + 1e-12  # George et al. (2018)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("name", LIKELIHOODS)
@pytest.mark.parametrize("rank", [1, 2, 5, None])
@pytest.mark.parametrize("cached", [None, "all"])
def test_def_diagonal_is_exact_and_beats_efb(
    name: str, arch: str, rank: int | None, cached: str | None, generator: torch.Generator
) -> None:
    _, bases, eigs, diag, blocks = _layers(name, generator, arch, cached)
    for basis, lam, exact in zip(bases, eigs, blocks):
        low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, lam, rank)
        correction = diagonal_correction(flat_to_grid(diag, basis.slot), low)
        dense = low.dense() + torch.diag(correction.reshape(-1))
        assert_close(dense.diagonal(), exact.diagonal())  # Prop. 1
        assert_close(kron_diag(low.factor_out, low.factor_in, low.eigenvalues).reshape(-1), low.dense().diagonal())
        if rank is None:  # Lemma 1: same off-diagonal as EFB, exact diagonal
            v = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
            efb = v @ torch.diag(lam.reshape(-1)) @ v.mT
            assert torch.linalg.norm(exact - dense) <= torch.linalg.norm(exact - efb) + 1e-12


def test_alg1_keeps_the_kronecker_closure_of_the_top_k() -> None:
    """Lee et al., Example 2: the top 3 of a 2 x 3 grid use two rows and two columns, so L = 4."""
    grid = torch.tensor([[6.0, 5.0, 1.0], [4.0, 3.0, 2.0]], dtype=torch.float64)
    eye2, eye3 = torch.eye(2, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    slot = kron_layout(nn.Sequential(nn.Linear(2, 2))).slots[0]
    low = sparsify(slot, eye2, eye3, grid, 3)
    assert low.rows.tolist() == [0, 1] and low.cols.tolist() == [0, 1]
    assert low.rank == 4
    assert_close(low.eigenvalues, torch.tensor([[6.0, 5.0], [4.0, 3.0]], dtype=torch.float64))
    assert sparsify(slot, eye2, eye3, grid, 1).rank == 1
    assert sparsify(slot, eye2, eye3, grid, None).rank == 6
    with pytest.raises(ValueError, match="rank must be >= 1"):
        sparsify(slot, eye2, eye3, grid, 0)


def test_fisher_needs_a_generator(generator: torch.Generator) -> None:
    model, theta, x, y, likelihood = _setup("gaussian", generator)
    with pytest.raises(ValueError, match="generator"):
        pseudo_grads(model, theta, x, y, likelihood, kind="fisher")
    with pytest.raises(ValueError, match="'hessian'"):
        pseudo_grads(model, theta, x, y, likelihood, kind="hessian")

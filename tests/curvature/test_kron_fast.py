"""The fast paths of the Kronecker curvature: shifted-product conv Grams, float32 work, no per-example gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import bdl_bench.curvature.pseudo_grads as pseudo_grads_module
from bdl_bench.curvature import conv_gram, kron
from bdl_bench.curvature.kron import ChunkCache, diagonal, efb_eigenvalues, eigenbasis, kron_factors
from bdl_bench.curvature.pseudo_grads import LayerPseudoGrads, iter_pseudo_grads, kron_layout
from bdl_bench.likelihoods import Categorical
from bdl_bench.models import build_model


@pytest.mark.parametrize(
    ("channels", "kernel", "padding", "bias"),
    [(3, (3, 3), (1, 1), True), (2, (2, 3), (0, 2), False), (1, (5, 5), (2, 2), True), (4, (1, 1), (0, 0), True)],
)
def test_shifted_products_give_the_patch_gram(
    channels: int, kernel: tuple[int, int], padding: tuple[int, int], bias: bool, generator: torch.Generator
) -> None:
    """sum_{i,t} [patch, 1][patch, 1]^T from window sums of shifted products equals the unfold GEMM."""
    conv = nn.Conv2d(channels, 2, kernel, padding=padding, bias=bias).double()
    slot = kron_layout(nn.Sequential(conv)).slots[0]
    assert slot.conv is not None
    x = torch.randn(5, channels, 6, 7, generator=generator, dtype=torch.float64)
    (kh, kw), (ph, pw) = kernel, padding
    padded = (6 + 2 * ph, 7 + 2 * pw)
    products = torch.zeros(kh, *padded, channels, (2 * kw - 1) * channels, dtype=torch.float64)
    sums = torch.zeros(*padded, channels, dtype=torch.float64)
    for part in x.split(2):  # accumulated over minibatches
        conv_gram.add_shifted_products_(products, sums, part, slot.conv)
    patches = F.unfold(x, kernel, padding=padding).mT.reshape(-1, slot.in_features)
    if bias:
        patches = torch.cat([patches, torch.ones_like(patches[:, :1])], 1)
    assert_close(conv_gram.shifted_gram(products, sums, 5, (6, 7), slot), patches.mT @ patches)


def _tiny_lenet(channels: list[int], generator: torch.Generator) -> tuple[nn.Module, Tensor]:
    """A LeNet on 8x8 images with the given conv widths, 16 hidden units and 3 classes, and random float64
    parameters for it (drawn from ``generator``)."""
    model = build_model(
        {"name": "lenet", "image_size": 8, "channels": channels, "hidden": 16, "dropout": 0.0},
        in_features=1,
        out_features=3,
    )
    n_params = sum(p.numel() for p in model.parameters())
    return model, 0.3 * torch.randn(n_params, generator=generator, dtype=torch.float64)


def _lenet_batches(dtype: torch.dtype, generator: torch.Generator, kind: str = "ggn"):
    """A shrunk LeNet (two padded 5x5 convs, pooling, two linear layers) on 40 images, chunks of 16."""
    model, theta = _tiny_lenet([3, 4], generator)
    data = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    x = torch.rand(40, 1, 8, 8, generator=data, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=data)
    labels = torch.Generator().manual_seed(7)
    return lambda: iter_pseudo_grads(
        model, theta.to(dtype), x, y, Categorical(), batch_size=16, kind=kind, generator=labels
    )


def test_shifted_path_is_taken_for_lenets_second_conv_only() -> None:
    lenet = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.Conv2d(32, 64, 5, padding=2), nn.Conv2d(64, 8, 2, stride=2)
    )
    slots = kron_layout(lenet).slots
    shapes = [torch.Size([64, 1, 28, 28]), torch.Size([64, 32, 14, 14]), torch.Size([64, 64, 14, 14])]
    assert [conv_gram.uses_shifted_gram(slot, shape) for slot, shape in zip(slots, shapes)] == [False, True, False]


def test_lenet_conv_factors_are_patch_grams(generator: torch.Generator, monkeypatch) -> None:
    monkeypatch.setattr(conv_gram, "MIN_SHIFTED_CHANNELS", 1)  # the shifted path for both of the tiny LeNet's convs
    batches = _lenet_batches(torch.float64, generator)
    first = next(batches())
    assert all(conv_gram.uses_shifted_gram(layer.slot, layer.layer_input.shape) for layer in first.layers[:2])
    for f, layer in zip(kron_factors(batches()), first.layers):
        if layer.slot.conv is None:
            continue
        n_rows = 0
        patch_gram = torch.zeros(layer.shape[1], layer.shape[1], dtype=torch.float64)
        for batch in batches():
            patches = batch.layers[[lay.slot for lay in batch.layers].index(layer.slot)].inputs.flatten(0, 1)
            patch_gram += patches.mT @ patches
            n_rows += batch.n_examples
        assert_close(f.a_factor, patch_gram / n_rows)


def test_float32_curvature_agrees_with_float64(generator: torch.Generator) -> None:
    """Factors, EFB eigenvalues and the diagonal from float32 pseudo-gradients (float64 sums) within ~1e-5."""
    seed = torch.Generator().manual_seed(3)
    f64 = _lenet_batches(torch.float64, seed)
    f32 = _lenet_batches(torch.float32, seed.manual_seed(3))
    factors64, factors32 = kron_factors(f64()), kron_factors(f32())
    for a, b in zip(factors64, factors32):
        assert b.a_factor.dtype == torch.float64
        assert_close(b.a_factor, a.a_factor, rtol=1e-5, atol=1e-6 * float(a.a_factor.abs().max()))
        assert_close(b.g_factor, a.g_factor, rtol=1e-5, atol=1e-6 * float(a.g_factor.abs().max()))
    bases = eigenbasis(factors64)
    (eigs64, diag64), (eigs32, diag32) = efb_eigenvalues(f64(), bases), efb_eigenvalues(f32(), bases)
    for a, b in zip(eigs64, eigs32):
        assert_close(b, a, rtol=1e-4, atol=1e-6 * float(a.max()))
    assert_close(diag32, diag64, rtol=1e-4, atol=1e-6 * float(diag64.max()))
    assert_close(diagonal(f32()), diag64, rtol=1e-4, atol=1e-6 * float(diag64.max()))


def test_kfac_factors_form_no_per_example_gradients(generator: torch.Generator, monkeypatch) -> None:
    """KFAC needs only GEMMs over the minibatch: per-example gradients and (stride-1) patches are never formed."""
    monkeypatch.setattr(conv_gram, "MIN_SHIFTED_CHANNELS", 1)
    batches = _lenet_batches(torch.float32, generator, kind="fisher")

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("per-example gradients or patches formed")

    monkeypatch.setattr(LayerPseudoGrads, "per_example", refuse)
    monkeypatch.setattr(pseudo_grads_module, "augmented_patches", refuse)
    factors = kron_factors(batches())
    assert [f.a_factor.shape[0] for f in factors] == [26, 76, 17, 17]


@pytest.mark.parametrize(("kernel", "padding", "bias"), [((3, 2), (1, 0), True), ((5, 5), (2, 2), False)])
def test_conv_per_example_gradients_without_patches_match_the_patch_formula(
    kernel: tuple[int, int], padding: tuple[int, int], bias: bool, generator: torch.Generator, monkeypatch
) -> None:
    conv = nn.Conv2d(3, 4, kernel, padding=padding, bias=bias).double()
    slot = kron_layout(nn.Sequential(conv)).slots[0]
    x = torch.randn(5, 3, 6, 7, generator=generator, dtype=torch.float64)
    out_hw = conv(x).shape[2:]
    deltas = torch.randn(2, 5, out_hw[0] * out_hw[1], 4, generator=generator, dtype=torch.float64)
    layer = LayerPseudoGrads(slot, x, deltas)
    patch_formula = deltas.transpose(2, 3) @ layer.inputs
    assert_close(layer.per_example(), patch_formula)  # 3 input channels: the patch GEMM
    padded = layer.per_example(slot.shape[1] + 5)
    assert_close(padded[..., : slot.shape[1]], patch_formula)
    assert not padded[..., slot.shape[1] :].any()
    # the tap GEMMs on the input map (no patches), as for channels >= _MIN_TAP_CHANNELS
    monkeypatch.setattr(pseudo_grads_module, "_MIN_TAP_CHANNELS", 1)
    fresh = LayerPseudoGrads(slot, x, deltas)
    assert_close(fresh.per_example(), patch_formula)
    padded = fresh.per_example(slot.shape[1] + 5)
    assert_close(padded[..., : slot.shape[1]], patch_formula)
    assert not padded[..., slot.shape[1] :].any()
    with pytest.raises(ValueError, match="width"):
        fresh.per_example(slot.shape[1] - 1)


@pytest.mark.parametrize(("kernel", "padding", "bias"), [((3, 2), (1, 0), True), ((5, 5), (2, 2), False)])
def test_efb_sums_from_conv_taps_match_the_pseudo_gradient_definition(
    kernel: tuple[int, int], padding: tuple[int, int], bias: bool, generator: torch.Generator, monkeypatch
) -> None:
    """The EFB pass's tap route (kernel-row GEMMs, U_A permuted, U_G as one GEMM, reused buffers) gives
    sum_ik (U_G^T g_ik U_A)^2 and sum_ik g_ik^2 of the patch formula g_ik = sum_t delta_ikt a_it^T, over
    minibatches of changing size (the scratch buffers shrink and grow)."""
    monkeypatch.setattr(pseudo_grads_module, "_MIN_TAP_CHANNELS", 1)
    conv = nn.Conv2d(3, 4, kernel, padding=padding, bias=bias).double()
    slot = kron_layout(nn.Sequential(conv)).slots[0]
    m, n = slot.shape
    basis = kron.KronEigenbasis(
        slot,
        torch.linalg.qr(torch.randn(m, m, generator=generator, dtype=torch.float64))[0],
        torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))[0],
        torch.ones(m, dtype=torch.float64),
        torch.ones(n, dtype=torch.float64),
    )
    sums = kron._EfbSums(slot, basis, torch.empty(0, dtype=torch.float64))
    want_eig = torch.zeros(m, n, dtype=torch.float64)
    want_diag = torch.zeros(m, n, dtype=torch.float64)
    for rows in (5, 3, 6):
        x = torch.randn(rows, 3, 6, 7, generator=generator, dtype=torch.float64)
        out_hw = conv(x).shape[2:]
        deltas = torch.randn(2, rows, out_hw[0] * out_hw[1], m, generator=generator, dtype=torch.float64)
        layer = LayerPseudoGrads(slot, x, deltas)
        assert layer.uses_conv_taps
        g = deltas.transpose(2, 3) @ layer.inputs  # (K, M, m, n), the patch formula
        want_eig += (basis.eigvecs_out.mT @ g @ basis.eigvecs_in).square().sum((0, 1))
        want_diag += g.square().sum((0, 1))
        sums.add(layer)
    got_eig, got_diag = sums.results()
    assert_close(got_eig, want_eig)
    assert_close(got_diag, want_diag)


@pytest.mark.parametrize("tap_channels", [8, 1])
@pytest.mark.parametrize("kind", ["fisher", "ggn"])
def test_cached_efb_pass_equals_recomputation_on_pass_1s_labels(
    kind: str, tap_channels: int, generator: torch.Generator, monkeypatch
) -> None:
    """The EFB pass over a ChunkCache (all chunks, a prefix, none) gives the eigenvalues and diagonal of pass 1's
    own pseudo-gradients: the same sampled labels, whether kept or recomputed from ``cache.labels``."""
    monkeypatch.setattr(pseudo_grads_module, "_MIN_TAP_CHANNELS", tap_channels)  # both conv per-example routes
    model, theta = _tiny_lenet([1, 9], generator)
    x = torch.rand(40, 1, 8, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=generator)

    def batches(rows: slice = slice(None), labels=None, seed: int = 5):
        return iter_pseudo_grads(
            model,
            theta,
            x[rows],
            y[rows],
            Categorical(),
            batch_size=16,
            kind=kind,
            generator=torch.Generator().manual_seed(seed),
            labels=labels,
        )

    first = list(batches())  # pass 1, kept whole: the reference
    factors = kron_factors(first)
    bases = eigenbasis(factors)
    eigs, diag = efb_eigenvalues(first, bases)
    assert (first[0].labels is not None) == (kind == "fisher")
    probe = ChunkCache(2**30)
    for _ in probe.record(batches()):
        pass
    # layer 0 (1 input channel, 8x8 output map) is kept as per-example gradients, the others as maps
    kept = next(probe.chunks())[1]
    assert isinstance(kept[0], torch.Tensor) and all(isinstance(entry, LayerPseudoGrads) for entry in kept[1:])
    for budget, n_cached in ((probe.nbytes, 3), (probe.nbytes // 2, 1), (0, 0)):
        cache = ChunkCache(budget)
        cached_factors = kron_factors(cache.record(batches()))
        assert cache.n_cached == n_cached and len(cache.labels) == 3
        for a, b in zip(cached_factors, factors):
            assert_close(a.a_factor, b.a_factor, rtol=0, atol=0)
            assert_close(a.g_factor, b.g_factor, rtol=0, atol=0)
        rows = cache.n_cached_rows
        # recompute the rest from a generator in another state: only cache.labels may matter
        rest = batches(slice(rows, None), cache.labels[n_cached:] if kind == "fisher" else None, seed=99)
        got_eigs, got_diag = efb_eigenvalues(rest, bases, cache=cache)
        for a, b in zip(got_eigs, eigs):
            assert_close(a, b)
        assert_close(got_diag, diag)


def test_cache_and_labels_refuse_bad_arguments(generator: torch.Generator) -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        ChunkCache(-1)
    model = nn.Sequential(nn.Linear(2, 3)).double()
    theta = torch.randn(9, generator=generator, dtype=torch.float64)
    x, y = torch.randn(5, 2, generator=generator, dtype=torch.float64), torch.zeros(5)
    with pytest.raises(ValueError, match="one entry per minibatch"):  # 3 minibatches of 2, 2, 1 rows
        next(iter_pseudo_grads(model, theta, x, y, Categorical(), batch_size=2, kind="fisher", labels=[None, None]))

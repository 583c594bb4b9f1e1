"""KL registry: every closed form against the dense fallback, dispatch order, refusals."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence
from torch.testing import assert_close

from bdl_bench.gaussians import (
    DiagGaussian,
    FullGaussian,
    LowRankPlusDiagGaussian,
    StructuredGaussian,
    kl,
    register_kl,
    sym_kl,
)

from .conftest import DIM, KINDS, MakeGaussian

# The package re-exports the function ``kl`` under the submodule's name; fetch the module itself.
kl_module = importlib.import_module("bdl_bench.gaussians.kl")

CLOSED_FORMS = [
    ("diag", "diag", kl_module._kl_to_diag),
    ("low_rank", "diag", kl_module._kl_to_diag),
    ("full", "diag", kl_module._kl_to_diag),
    ("diag", "low_rank", kl_module._kl_to_low_rank),
    ("low_rank", "low_rank", kl_module._kl_to_low_rank),
    ("full", "low_rank", kl_module._kl_to_low_rank),
    ("full", "full", kl_module._kl_full_full),
]
DENSE_ONLY = [("diag", "full"), ("low_rank", "full")]


def torch_kl(p: StructuredGaussian, q: StructuredGaussian) -> torch.Tensor:
    def mvn(g: StructuredGaussian) -> MultivariateNormal:
        return MultivariateNormal(g.mean, precision_matrix=g.to_dense().precision)

    return kl_divergence(mvn(p), mvn(q))


@pytest.mark.parametrize(("kind_p", "kind_q", "expected"), CLOSED_FORMS)
def test_closed_form_matches_dense_fallback(
    make_gaussian: MakeGaussian, kind_p: str, kind_q: str, expected: object
) -> None:
    p = make_gaussian(kind_p)
    q = make_gaussian(kind_q, rank=3)  # a different rank than p's where both are low rank
    assert kl_module._dispatch(type(p), type(q)) is expected
    value = kl(p, q)
    assert value.shape == ()
    assert value > 0
    assert_close(value, kl_module._kl_dense(p, q))


@pytest.mark.parametrize("kind_p", KINDS)
@pytest.mark.parametrize("kind_q", KINDS)
def test_every_pair_matches_torch_distributions(make_gaussian: MakeGaussian, kind_p: str, kind_q: str) -> None:
    p, q = make_gaussian(kind_p), make_gaussian(kind_q)
    expected = torch_kl(p, q)
    assert_close(kl(p, q), expected)
    assert_close(kl_module._kl_dense(p, q), expected)
    assert_close(p.kl(q), expected)


@pytest.mark.parametrize(("kind_p", "kind_q"), DENSE_ONLY)
def test_pairs_without_closed_form_use_dense_fallback(make_gaussian: MakeGaussian, kind_p: str, kind_q: str) -> None:
    p, q = make_gaussian(kind_p), make_gaussian(kind_q)
    assert kl_module._dispatch(type(p), type(q)) is kl_module._kl_dense


def test_kl_of_a_gaussian_with_itself_is_zero(gaussian: StructuredGaussian) -> None:
    zero = torch.zeros((), dtype=torch.float64)
    assert_close(kl(gaussian, gaussian), zero, atol=1e-10, rtol=0)
    assert_close(kl(gaussian, gaussian.to_dense()), zero, atol=1e-10, rtol=0)
    assert_close(gaussian.sym_kl(gaussian), zero, atol=1e-10, rtol=0)


@pytest.mark.parametrize(("kind_p", "kind_q"), [("diag", "low_rank"), ("low_rank", "full")])
def test_sym_kl_is_symmetric(make_gaussian: MakeGaussian, kind_p: str, kind_q: str) -> None:
    p, q = make_gaussian(kind_p), make_gaussian(kind_q)
    assert_close(sym_kl(p, q), sym_kl(q, p))
    assert_close(sym_kl(p, q), kl(p, q) + kl(q, p))
    assert_close(p.sym_kl(q), q.sym_kl(p))


def test_float32_kl(make_gaussian: MakeGaussian) -> None:
    p, q = make_gaussian("low_rank"), make_gaussian("low_rank", rank=3)
    p32 = LowRankPlusDiagGaussian(p.mean.float(), p.prec_factor.float(), p.prec_diag.float())  # type: ignore[attr-defined]
    q32 = LowRankPlusDiagGaussian(q.mean.float(), q.prec_factor.float(), q.prec_diag.float())  # type: ignore[attr-defined]
    value = kl(p32, q32)
    assert value.dtype == torch.float32
    assert_close(value.double(), kl(p, q), rtol=1e-4, atol=1e-5)


def test_dense_fallback_refuses_large_dimension(make_gaussian: MakeGaussian, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kl_module, "_DENSE_KL_MAX_DIM", DIM - 1)
    p, q = make_gaussian("diag"), make_gaussian("full")
    with pytest.raises(NotImplementedError, match=rf"\(DiagGaussian, FullGaussian\).*D={DIM}"):
        kl(p, q)
    # Closed forms do not depend on the limit.
    assert torch.isfinite(kl(make_gaussian("low_rank"), p))


def test_dimension_and_type_checks(make_gaussian: MakeGaussian) -> None:
    with pytest.raises(ValueError, match="D=7 and D=5"):
        kl(make_gaussian("diag"), make_gaussian("diag", dim=5))
    with pytest.raises(TypeError, match="StructuredGaussian"):
        kl(make_gaussian("diag"), torch.zeros(DIM))  # type: ignore[arg-type]


class _SubDiag(DiagGaussian):
    pass


def _f_any(p: StructuredGaussian, q: StructuredGaussian) -> torch.Tensor:
    raise AssertionError


def _f_diag(p: StructuredGaussian, q: StructuredGaussian) -> torch.Tensor:
    raise AssertionError


def _f_sub_any(p: StructuredGaussian, q: StructuredGaussian) -> torch.Tensor:
    raise AssertionError


def _f_diag_sub(p: StructuredGaussian, q: StructuredGaussian) -> torch.Tensor:
    raise AssertionError


def test_lookup_prefers_p_mro_then_q_mro() -> None:
    registry = {
        (StructuredGaussian, StructuredGaussian): _f_any,
        (DiagGaussian, DiagGaussian): _f_diag,
        (_SubDiag, StructuredGaussian): _f_sub_any,
        (DiagGaussian, _SubDiag): _f_diag_sub,
    }
    assert kl_module._lookup(registry, DiagGaussian, DiagGaussian) is _f_diag
    assert kl_module._lookup(registry, _SubDiag, DiagGaussian) is _f_sub_any
    assert kl_module._lookup(registry, _SubDiag, _SubDiag) is _f_sub_any
    assert kl_module._lookup(registry, DiagGaussian, _SubDiag) is _f_diag_sub
    assert kl_module._lookup(registry, FullGaussian, DiagGaussian) is _f_any
    with pytest.raises(NotImplementedError, match=r"\(FullGaussian, DiagGaussian\)"):
        kl_module._lookup({(DiagGaussian, DiagGaussian): _f_diag}, FullGaussian, DiagGaussian)


def test_subclass_inherits_closed_form(make_gaussian: MakeGaussian) -> None:
    p = make_gaussian("diag")
    sub = _SubDiag(p.mean, p.prec_diag)  # type: ignore[attr-defined]
    q = make_gaussian("diag")
    assert kl_module._dispatch(_SubDiag, DiagGaussian) is kl_module._kl_to_diag
    assert_close(kl(sub, q), kl(p, q))
    assert_close(kl(q, sub), kl(q, p))


def test_register_kl_guards() -> None:
    before = dict(kl_module._KL_REGISTRY)
    with pytest.raises(TypeError, match="StructuredGaussian subclasses"):
        register_kl(DiagGaussian, int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StructuredGaussian subclasses"):
        register_kl(DiagGaussian(torch.zeros(1), torch.ones(1)), DiagGaussian)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(StructuredGaussian, DiagGaussian\) is already registered"):
        register_kl(StructuredGaussian, DiagGaussian)(_f_diag)
    assert kl_module._KL_REGISTRY == before

r"""KL divergences between structured Gaussians, dispatched on the pair of classes.

For :math:`p = \mathcal N(\mu_p, P_p^{-1})` and :math:`q = \mathcal N(\mu_q, P_q^{-1})` in D dimensions,
written with precisions (:math:`\log|\Sigma_q| - \log|\Sigma_p| = \log|P_p| - \log|P_q|`):

.. math::

    \mathrm{KL}(p\,\|\,q) = \tfrac12\left[\operatorname{tr}(P_q\Sigma_p)
        + (\mu_q-\mu_p)^\top P_q(\mu_q-\mu_p) - D + \log|P_p| - \log|P_q|\right].

Each registered pair evaluates the trace term with its structure; the Mahalanobis term is always
``precision_matvec`` and the log-determinants ``logdet_precision`` (matrix determinant lemma for
low rank). ``kl(p, q)`` picks the most specific registered pair -- ranked by the position of the
registered classes in ``type(p).__mro__`` first, then ``type(q).__mro__`` -- and memoises the choice.
``(StructuredGaussian, StructuredGaussian)`` is a dense fallback through ``to_dense()``, refused
above ``_DENSE_KL_MAX_DIM``. A new class adds its pairs with ``@register_kl`` without touching
this module's pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from bdl_bench.gaussians.base import StructuredGaussian
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.gaussians.full import FullGaussian
from bdl_bench.gaussians.low_rank import LowRankPlusDiagGaussian

KLFn = Callable[[StructuredGaussian, StructuredGaussian], Tensor]

_KL_REGISTRY: dict[tuple[type[StructuredGaussian], type[StructuredGaussian]], KLFn] = {}

_DENSE_KL_MAX_DIM = 5000  # largest D for which the dense fallback forms D x D matrices


def register_kl(type_p: type[StructuredGaussian], type_q: type[StructuredGaussian]) -> Callable[[KLFn], KLFn]:
    """Decorator registering ``fn(p, q) -> KL(p || q)`` for the pair ``(type_p, type_q)`` (subclasses match
    too); it returns ``fn`` unchanged, so decorators stack. A pair registered twice raises ``ValueError``."""
    for t in (type_p, type_q):
        if not (isinstance(t, type) and issubclass(t, StructuredGaussian)):
            raise TypeError(f"register_kl expects StructuredGaussian subclasses, got {t!r}")

    def add(fn: KLFn) -> KLFn:
        key = (type_p, type_q)
        if key in _KL_REGISTRY:
            raise ValueError(
                f"KL pair ({type_p.__name__}, {type_q.__name__}) is already registered to {_KL_REGISTRY[key].__name__}"
            )
        _KL_REGISTRY[key] = fn
        _dispatch.cache_clear()
        return fn

    return add


def _lookup(registry: Mapping[tuple[type, type], KLFn], type_p: type, type_q: type) -> KLFn:
    """The registered function of the most specific matching pair (p's MRO first, then q's)."""
    best: KLFn | None = None
    best_rank: tuple[int, int] | None = None
    for (reg_p, reg_q), fn in registry.items():
        if issubclass(type_p, reg_p) and issubclass(type_q, reg_q):
            rank = (type_p.__mro__.index(reg_p), type_q.__mro__.index(reg_q))
            if best_rank is None or rank < best_rank:
                best, best_rank = fn, rank
    if best is None:
        raise NotImplementedError(
            f"no KL registered for ({type_p.__name__}, {type_q.__name__}); registered: "
            + ", ".join(f"({p.__name__}, {q.__name__})" for p, q in registry)
        )
    return best


@functools.cache
def _dispatch(type_p: type, type_q: type) -> KLFn:
    return _lookup(_KL_REGISTRY, type_p, type_q)


def kl(p: StructuredGaussian, q: StructuredGaussian) -> Tensor:
    r""":math:`\mathrm{KL}(p\,\|\,q)` by the most specific registered pair (module docstring), a scalar."""
    for name, g in (("p", p), ("q", q)):
        if not isinstance(g, StructuredGaussian):
            raise TypeError(f"{name} must be a StructuredGaussian, got {type(g).__name__}")
    if p.dim != q.dim:
        raise ValueError(f"KL needs equal dimensions, got D={p.dim} and D={q.dim}")
    return _dispatch(type(p), type(q))(p, q)


def sym_kl(p: StructuredGaussian, q: StructuredGaussian) -> Tensor:
    r"""Symmetric KL :math:`\mathrm{KL}(p\,\|\,q) + \mathrm{KL}(q\,\|\,p)`; see ``kl``."""
    return kl(p, q) + kl(q, p)


def _assemble(p: StructuredGaussian, q: StructuredGaussian, trace: Tensor, maha: Tensor | None = None) -> Tensor:
    r"""The KL from its trace term and the Mahalanobis term (by default :math:`\delta^\top P_q\delta`)."""
    if maha is None:
        delta = q.mean - p.mean
        maha = delta @ q.precision_matvec(delta)
    return 0.5 * (trace + maha - p.dim + p.logdet_precision() - q.logdet_precision())


@register_kl(StructuredGaussian, DiagGaussian)
def _kl_to_diag(p: StructuredGaussian, q: DiagGaussian) -> Tensor:
    r"""KL to a diagonal q: :math:`\operatorname{tr}(P_q\Sigma_p) = \sum_i d_{q,i}\,\Sigma_{p,ii}`, at the cost of
    ``p.variance()`` and ``p.logdet_precision()`` (O(D L^2) for a low-rank p, blockwise for a block p)."""
    trace = (q.prec_diag * p.variance()).sum()
    return _assemble(p, q, trace)


@register_kl(StructuredGaussian, LowRankPlusDiagGaussian)
def _kl_to_low_rank(p: StructuredGaussian, q: LowRankPlusDiagGaussian) -> Tensor:
    r"""KL to :math:`P_q = U_qU_q^\top + \operatorname{diag}(d_q)`.

    :math:`\operatorname{tr}(P_q\Sigma_p) = \operatorname{tr}(U_q^\top\Sigma_pU_q)
    + \sum_i d_{q,i}\Sigma_{p,ii}`, with :math:`\Sigma_pU_q` from ``p.solve`` (Woodbury for a
    low-rank p). Cost: O(D L_q) for a diagonal p, O(D L_p (L_p + L_q)) for a low-rank p.
    """
    factor_q = q.prec_factor
    trace = (factor_q * p.solve(factor_q)).sum() + (q.prec_diag * p.variance()).sum()
    return _assemble(p, q, trace)


@register_kl(FullGaussian, FullGaussian)
def _kl_full_full(p: FullGaussian, q: FullGaussian) -> Tensor:
    r"""Dense KL with Choleskys :math:`P = LL^\top`: :math:`\operatorname{tr}(P_q\Sigma_p)
    = \|L_p^{-1}L_q\|_F^2`, Mahalanobis :math:`\|L_q^\top\delta\|^2`. O(D^3)."""
    trace = torch.linalg.solve_triangular(p._chol, q._chol, upper=False).square().sum()
    maha = (q._chol.mT @ (q.mean - p.mean)).square().sum()
    return _assemble(p, q, trace, maha)


@register_kl(StructuredGaussian, StructuredGaussian)
def _kl_dense(p: StructuredGaussian, q: StructuredGaussian) -> Tensor:
    """Fallback for any pair: ``_kl_full_full(p.to_dense(), q.to_dense())``, O(D^3), up to ``_DENSE_KL_MAX_DIM``."""
    if p.dim > _DENSE_KL_MAX_DIM:
        raise NotImplementedError(
            f"no closed-form KL for ({type(p).__name__}, {type(q).__name__}) and D={p.dim} "
            f"exceeds the dense fallback's limit of {_DENSE_KL_MAX_DIM}; register a closed form "
            "with @register_kl"
        )
    return _kl_full_full(p.to_dense(), q.to_dense())

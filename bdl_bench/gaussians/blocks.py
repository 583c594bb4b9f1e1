r"""Gaussians whose precision is block diagonal in a permuted order: the base of the Laplace family.

A network's curvature is approximated layer by layer (Lee et al. 2020, Sec. 2.1: the weights of
different layers are uncorrelated). ``BlockGaussian`` holds that layout once:

* ``index`` ``(D,)`` (long): a permutation; position p of the *blocked order* holds flat coordinate
  ``index[p]``, i.e. the blocked vector is ``v[index]``;
* ``shapes`` ``(B, 2)`` (long): block b covers the next :math:`m_b n_b` positions of the blocked
  order, read as an :math:`m_b\times n_b` matrix, row-major (for a linear layer :math:`[W, b]`:
  m = outputs, n = inputs + 1; see ``bdl_bench.curvature.pseudo_grads``).

:math:`P = \Pi^\top\operatorname{blockdiag}(P_1,\dots,P_B)\,\Pi` with :math:`\Pi` the permutation, so
every operation of ``StructuredGaussian`` is the blockwise operation (:math:`\log|P| = \sum_b\log|P_b|`,
:math:`\Sigma = \Pi^\top\operatorname{blockdiag}(P_b^{-1})\Pi`, samples blockwise). Subclasses give
the per-block pieces on right-hand sides shaped ``(K, m, n)``. ``BlockDiagGaussian`` (dense blocks)
is the exact block-diagonal Laplace ("FB" in Lee et al., Fig. 4); ``kron.py`` and ``def_lowrank.py``
hold the Kronecker structures. Per-block matrices are stored flattened and concatenated (:func:`pack`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from bdl_bench.gaussians.base import StructuredGaussian
from bdl_bench.gaussians.full import FullGaussian, check_symmetric, cholesky


def pack(matrices: Sequence[Tensor]) -> Tensor:
    """Flatten and concatenate per-block tensors into one vector (the storage of the fields)."""
    return torch.cat([m.reshape(-1) for m in matrices])


def _check_long(name: str, value: Tensor, ndim: int) -> None:
    if not isinstance(value, Tensor) or value.dtype != torch.long or value.ndim != ndim:
        got = f"{value.dtype} with {value.ndim} dims" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a {ndim}-D torch.long tensor, got {got}")


@dataclass(frozen=True, eq=False, repr=False)
class BlockGaussian(StructuredGaussian):
    """Abstract block-diagonal precision in a permuted order (see the module docstring)."""

    index: Tensor  # (D,) long, a permutation of 0..D-1
    shapes: Tensor  # (B, 2) long, sum_b m_b n_b = D

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_long("index", self.index, 1)
        _check_long("shapes", self.shapes, 2)
        if self.index.device != self.device or self.shapes.device != self.device:
            raise ValueError(f"index and shapes must be on mean's device {self.device}")
        if self.index.shape[0] != self.dim:
            raise ValueError(f"index must have D={self.dim} entries, got {self.index.shape[0]}")
        if not torch.equal(torch.sort(self.index).values, torch.arange(self.dim, device=self.device)):
            raise ValueError("index must be a permutation of 0..D-1")
        if self.shapes.shape[1] != 2 or self.shapes.shape[0] < 1 or bool((self.shapes < 1).any()):
            raise ValueError(f"shapes must be (B, 2) with positive entries, got {self.shapes.tolist()}")
        if int(self.shapes.prod(1).sum()) != self.dim:
            raise ValueError(
                f"blocks of shapes {self.shapes.tolist()} cover {int(self.shapes.prod(1).sum())} != D={self.dim}"
            )

    @cached_property
    def block_shapes(self) -> list[tuple[int, int]]:
        """``[(m_b, n_b), ...]`` as Python ints."""
        return [(int(m), int(n)) for m, n in self.shapes.tolist()]

    @cached_property
    def _block_index(self) -> list[Tensor]:
        """Flat coordinates of each block, in its row-major order."""
        return list(torch.split(self.index, [m * n for m, n in self.block_shapes]))

    def _unpack(self, flat: Tensor, sizes: Sequence[tuple[int, ...]]) -> list[Tensor]:
        counts = [math.prod(s) for s in sizes]
        if flat.ndim != 1 or flat.shape[0] != sum(counts):
            raise ValueError(f"packed field has {flat.numel()} entries, blocks {list(sizes)} need {sum(counts)}")
        return [part.view(*s) for part, s in zip(torch.split(flat, counts), sizes)]

    def _split(self, v: Tensor) -> list[Tensor]:
        """``(D, K)`` flat → per block ``(K, m, n)``."""
        return [v[idx].mT.reshape(v.shape[1], m, n) for idx, (m, n) in zip(self._block_index, self.block_shapes)]

    def _join(self, blocks: Sequence[Tensor]) -> Tensor:
        """Per block ``(K, m, n)`` → ``(D, K)`` flat."""
        n_cols = blocks[0].shape[0]
        out = torch.empty(self.dim, n_cols, dtype=self.dtype, device=self.device)
        for idx, block in zip(self._block_index, blocks):
            out[idx] = block.reshape(n_cols, -1).mT
        return out

    @abstractmethod
    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        """:math:`P_b x` for ``x`` ``(K, m, n)``."""

    @abstractmethod
    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        """:math:`P_b^{-1} x` for ``x`` ``(K, m, n)``."""

    @abstractmethod
    def _block_logdet(self, b: int) -> Tensor:
        """:math:`\\log|P_b|`."""

    @abstractmethod
    def _block_variance(self, b: int) -> Tensor:
        """:math:`\\operatorname{diag}(P_b^{-1})` as an ``(m, n)`` grid."""

    @abstractmethod
    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """:math:`A_b\\epsilon` with :math:`A_bA_b^\\top = P_b^{-1}`, for ``eps`` ``(K, m, n)``."""

    @abstractmethod
    def _block_dense(self, b: int) -> Tensor:
        """:math:`P_b` as a dense ``(m·n, m·n)`` matrix (for tests)."""

    def _map_blocks(self, v: Tensor, fn: Callable[[int, Tensor], Tensor]) -> Tensor:
        """``fn(b, x)`` on every block ``x`` ``(K, m, n)`` of ``v`` ``(D,)`` or ``(D, K)``, joined back."""
        return self._on_columns(v, lambda cols: self._join([fn(b, x) for b, x in enumerate(self._split(cols))]))

    def precision_matvec(self, v: Tensor) -> Tensor:
        return self._map_blocks(v, self._block_matvec)

    def solve(self, v: Tensor) -> Tensor:
        return self._map_blocks(v, self._block_solve)

    def logdet_precision(self) -> Tensor:
        return torch.stack([self._block_logdet(b) for b in range(len(self.block_shapes))]).sum()

    def variance(self) -> Tensor:
        return self._join([self._block_variance(b)[None] for b in range(len(self.block_shapes))])[:, 0]

    def _sample_transform(self, eps: Tensor) -> Tensor:
        """Rows :math:`\\mu + \\Pi^\\top\\operatorname{blockdiag}(A_b)\\Pi\\epsilon`, gathered and added back
        block by block (contiguous ``(n, m, n)`` blocks, no transposed copies of the whole sample)."""
        n_rows = eps.shape[0]
        out = self.mean.expand(n_rows, -1).clone()
        for b, (idx, (m, n)) in enumerate(zip(self._block_index, self.block_shapes)):
            block = self._block_sample(b, eps.index_select(1, idx).view(n_rows, m, n))
            out.index_add_(1, idx, block.reshape(n_rows, -1))
        return out

    def to_dense(self) -> FullGaussian:
        precision = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
        for b, idx in enumerate(self._block_index):
            precision[idx[:, None], idx[None, :]] = self._block_dense(b)
        return FullGaussian(self.mean, 0.5 * (precision + precision.mT))


@dataclass(frozen=True, eq=False, repr=False)
class BlockDiagGaussian(BlockGaussian):
    """Dense precision blocks :math:`P_b` (exact block-diagonal Laplace, "FB" in Lee et al.); a block that is not
    positive definite raises ``ValueError`` on first use."""

    blocks: Tensor  # (sum (m n)^2,): the symmetric P_b, packed (:func:`pack`)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("blocks", self.blocks, (sum((m * n) ** 2 for m, n in self.block_shapes),))
        for b, block in enumerate(self._blocks):
            check_symmetric(f"precision block {b}", block)

    @cached_property
    def _blocks(self) -> list[Tensor]:
        return self._unpack(self.blocks, [(m * n, m * n) for m, n in self.block_shapes])

    @cached_property
    def _chols(self) -> list[Tensor]:
        return [cholesky(block, f"precision block {b}") for b, block in enumerate(self._blocks)]

    def _flat(self, b: int, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], -1).mT  # (mn, K)

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        return (self._blocks[b] @ self._flat(b, x)).mT.reshape(x.shape)

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        return torch.cholesky_solve(self._flat(b, x), self._chols[b]).mT.reshape(x.shape)

    def _block_logdet(self, b: int) -> Tensor:
        return 2.0 * self._chols[b].diagonal().log().sum()

    def _block_variance(self, b: int) -> Tensor:
        m, n = self.block_shapes[b]
        return torch.cholesky_inverse(self._chols[b]).diagonal().reshape(m, n)

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """:math:`L_b^{-\\top}\\epsilon` with :math:`P_b = L_bL_b^\\top`."""
        out = torch.linalg.solve_triangular(self._chols[b].mT, self._flat(b, eps), upper=True)
        return out.mT.reshape(eps.shape)

    def _block_dense(self, b: int) -> Tensor:
        return self._blocks[b]


@dataclass(frozen=True, eq=False, repr=False)
class BlockEigenGaussian(BlockGaussian):
    r"""Precision blocks in eigenform :math:`P_b = V_b\operatorname{diag}(\lambda_b)V_b^\top`, where an eigenvalue may
    be :math:`+\infty`: the posterior has zero variance along that eigenvector (it stays at the mean).

    This is how Lee et al. (2020, App. E.1) treat parameters that carry no information (a zero eigenvalue of the
    curvature with τ = 0): deterministic, so that the rest of the block is non-degenerate. With every
    :math:`\lambda` finite it is ``BlockDiagGaussian`` of :math:`V\Lambda V^\top`. :math:`\Sigma_b =
    V_b\Lambda_b^{-1}V_b^\top` and samples :math:`V_b\Lambda_b^{-1/2}\epsilon` use :math:`1/\infty = 0`; the
    precision itself (``precision_matvec``, ``to_dense``) exists only when every eigenvalue is finite."""

    eigvecs: Tensor  # (sum (m n)^2,): the orthogonal V_b, packed (:func:`pack`)
    eigvals: Tensor  # (D,): each block's eigenvalues in turn, > 0 or +inf

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_param("eigvecs", self.eigvecs, (sum((m * n) ** 2 for m, n in self.block_shapes),))
        self._check_param("eigvals", self.eigvals, (self.dim,))
        if not bool((self.eigvals > 0).all()):
            raise ValueError(f"eigvals must be positive or +inf, got min {self.eigvals.min().item():.3g}")

    @cached_property
    def _vecs(self) -> list[Tensor]:
        return self._unpack(self.eigvecs, [(m * n, m * n) for m, n in self.block_shapes])

    @cached_property
    def _inv_vals(self) -> list[Tensor]:
        """Per block :math:`1/\\lambda` (0 along the deterministic directions)."""
        return list(torch.split(self.eigvals.reciprocal(), [m * n for m, n in self.block_shapes]))

    @property
    def n_deterministic(self) -> int:
        """Directions with infinite precision (zero variance)."""
        return int(torch.isinf(self.eigvals).sum())

    def _finite(self, what: str) -> None:
        if self.n_deterministic:
            raise ValueError(f"{what} is infinite along the {self.n_deterministic} deterministic directions")

    def _in_basis(self, b: int, x: Tensor, scale: Tensor) -> Tensor:
        """:math:`V_b\\operatorname{diag}(s)V_b^\\top x` for ``x`` ``(K, m, n)``."""
        flat = x.reshape(x.shape[0], -1).mT
        return (self._vecs[b] @ (scale[:, None] * (self._vecs[b].mT @ flat))).mT.reshape(x.shape)

    def _block_matvec(self, b: int, x: Tensor) -> Tensor:
        self._finite("the precision")
        return self._in_basis(b, x, self._inv_vals[b].reciprocal())

    def _block_solve(self, b: int, x: Tensor) -> Tensor:
        return self._in_basis(b, x, self._inv_vals[b])

    def _block_logdet(self, b: int) -> Tensor:
        return self._inv_vals[b].log().neg().sum()  # +inf with a deterministic direction

    def _block_variance(self, b: int) -> Tensor:
        m, n = self.block_shapes[b]
        return (self._vecs[b].square() @ self._inv_vals[b]).reshape(m, n)

    def _block_sample(self, b: int, eps: Tensor) -> Tensor:
        """:math:`V_b\\Lambda_b^{-1/2}\\epsilon`."""
        flat = eps.reshape(eps.shape[0], -1).mT
        return (self._vecs[b] @ (self._inv_vals[b].sqrt()[:, None] * flat)).mT.reshape(eps.shape)

    def _block_dense(self, b: int) -> Tensor:
        self._finite("the precision")
        return (self._vecs[b] * self._inv_vals[b].reciprocal()) @ self._vecs[b].mT

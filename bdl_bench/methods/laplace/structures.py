r"""The six approximations of the Laplace precision :math:`P = N\mathbf I + \operatorname{diag}(\tau)`, one class each.

A structure's :meth:`~LaplaceStructure.curvature` is the data pass, independent of N and τ, so one pass serves every
point of a hyperparameter search (DEF's Alg. 1 and diagonal correction too: they use only the unscaled eigenvalues
and the exact diagonal); :meth:`~LaplaceStructure.assemble` builds the float64 posterior of precision
:math:`N\mathbf I + \operatorname{diag}(\tau)` from its output, differentiable in N and τ (for the marginal
likelihood). Both record what the fit reports in ``info`` (the method's ``fit_info``)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, ClassVar

import torch
from torch import Tensor

from bdl_bench.curvature.def_lowrank import diagonal_correction, sparsify
from bdl_bench.curvature.exact import exact_blocks, exact_matrix
from bdl_bench.curvature.kron import (
    ChunkCache,
    KronEigenbasis,
    diagonal,
    efb_eigenvalues,
    eigenbasis,
    flat_to_grid,
    kron_factors,
)
from bdl_bench.curvature.pseudo_grads import KronLayout, PseudoGrads, block_index
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, FullGaussian, StructuredGaussian
from bdl_bench.gaussians.blocks import BlockDiagGaussian, BlockEigenGaussian, pack
from bdl_bench.gaussians.def_lowrank import KroneckerLowRankPlusDiagGaussian
from bdl_bench.gaussians.kron import EigenKroneckerGaussian, KroneckerGaussian, ScaledEigenKroneckerGaussian

logger = logging.getLogger(__name__)

DEF_RANKS_FILE = "def_ranks.csv"  # DEF's per-layer reduction in the run folder (bdl_bench.report.def_ranks)
MAX_DEF_RANK = 16384  # largest L per layer for DEF (its L x L core: 2 GiB in float64)
MAX_DENSE_BLOCK = 16384  # null_space=deterministic: largest layer whose block is formed densely (2 GiB)

Batches = Callable[..., Iterable[PseudoGrads]]  # batches(start=0, labels=None): Laplace.fit_posterior's


class NullSpace(str, Enum):
    r"""``method.null_space``: what the posterior does along directions the precision :math:`N\mathbf I + \tau`
    does not determine (zero eigenvalues; only possible with τ = 0)."""

    PRIOR = "prior"  # nothing: τ > 0 is required and governs them
    DETERMINISTIC = "deterministic"  # zero variance there (Lee et al. App. E.1)


class Structure(str, Enum):
    """``method.structure``: its class in :data:`STRUCTURES`."""

    DIAG = "diag"
    KFAC = "kfac"
    EFB = "efb"
    DEF = "def"
    BLOCK = "block"
    FULL = "full"


class KfacPrior(str, Enum):
    r"""How ``structure=kfac`` adds the prior to :math:`NG\otimes A` (:class:`Kfac`)."""

    DAMPED = "damped"
    r"""Lee et al. eq. 3: :math:`(\sqrt N G + \sqrt\tau I)\otimes(\sqrt N A + \sqrt\tau I)` (exact where τ varies in a layer)."""
    EXACT = "exact"
    r""":math:`NG\otimes A + \operatorname{diag}(\tau)`, in the Kronecker eigenbasis."""


class LaplaceStructure(ABC):
    """One structure's curvature pass and assembly (module docstring), for the weight layers of ``layout``
    (:func:`~bdl_bench.curvature.pseudo_grads.kron_layout`); ``rank``, ``kfac_prior``, ``cache_mib`` (pass 1's
    MiB kept for the second pass) and ``progress`` matter to the structures that name them."""

    name: ClassVar[Structure]

    def __init__(
        self,
        layout: KronLayout,
        info: dict[str, float],
        *,
        rank: int | None = None,
        kfac_prior: KfacPrior = KfacPrior.DAMPED,
        cache_mib: int = 0,
        progress: bool = False,
    ) -> None:
        self.layout, self.info, self.rank, self.kfac_prior = layout, info, rank, kfac_prior
        self.cache_mib, self.progress = cache_mib, progress

    @abstractmethod
    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        """The data pass (``theta``: the float64 MAP)."""

    @abstractmethod
    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        """The float64 posterior :math:`\\mathcal N(\\theta, (N\\mathbf I + \\operatorname{diag}(\\tau))^{-1})`, N =
        ``scale``, τ = ``tau`` ``(D,)``."""

    def dense_blocks(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> list[Tensor]:
        r"""Each layer's precision block :math:`N\mathbf I_l + \operatorname{diag}(\tau_l)`, dense, in blocked order
        (structures that can form it: ``block``, ``efb`` and ``def``; the method checks this before it trains)."""
        raise NotImplementedError(f"structure={self.name.value} does not form dense precision blocks")

    def assemble_deterministic(
        self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor, eps: float
    ) -> BlockEigenGaussian:
        r"""The posterior with zero variance along every eigenvector of a layer's precision block whose eigenvalue
        is zero to the precision of the curvature: at most n·``eps`` times the block's largest (n its size, ``eps``
        the machine epsilon of the dtype the curvature was computed in; numpy's ``matrix_rank`` rule). Lee et al.
        (2020, App. E.1) make zero-information parameters deterministic so that the information matrix is
        non-degenerate with τ = 0, and keep "the maximum rank ... after removing all the zero eigenvalues" (App. E.3)."""
        for slot in self.layout.slots:
            size = slot.shape[0] * slot.shape[1]
            if size > MAX_DENSE_BLOCK:
                raise ConfigError(
                    f"laplace: method.null_space=deterministic eigendecomposes each layer's precision as a dense "
                    f"block, but layer {slot.module_index} has {size} parameters (limit {MAX_DENSE_BLOCK}); use "
                    "null_space=prior with a prior_precision > 0"
                )
        vecs, vals = [], []
        for block in self.dense_blocks(theta, curvature, scale, tau):
            lam, vec = torch.linalg.eigh(block)
            zero = lam <= block.shape[0] * eps * lam.max().clamp_min(0.0)
            vals.append(torch.where(zero, torch.inf, lam))
            vecs.append(vec)
        return BlockEigenGaussian(*self.blocked(theta), pack(vecs), torch.cat(vals))

    def blocked(self, theta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A ``BlockGaussian``'s first fields: ``theta``, the flat index of every layer's grid (bias column
        included) and the grids' shapes."""
        index = torch.cat([block_index(slot, theta.device) for slot in self.layout.slots])
        shapes = torch.tensor([list(slot.shape) for slot in self.layout.slots], device=theta.device)
        return theta, index, shapes

    def layer_taus(self, tau: Tensor) -> list[Tensor]:
        """τ ``(D,)`` of every layer as its ``(m, n)`` grid (the bias column last)."""
        return [tau[block_index(slot, tau.device)].view(slot.shape) for slot in self.layout.slots]


class Diag(LaplaceStructure):
    r""":math:`\operatorname{diag}(\mathbf I)` → ``DiagGaussian`` (Ritter et al. 2018's Diag)."""

    name = Structure.DIAG

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        return {"diag": diagonal(batches())}

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        return DiagGaussian(theta, scale * curvature["diag"] + tau)


class Full(LaplaceStructure):
    r"""The whole :math:`N\mathbf I + \operatorname{diag}(\tau)` → ``FullGaussian`` (small nets)."""

    name = Structure.FULL

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        return {"matrix": exact_matrix(batches())}

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        return FullGaussian(theta, scale * curvature["matrix"] + torch.diag(tau))


class Block(LaplaceStructure):
    r"""The exact per-layer blocks :math:`N\mathbf I_l + \operatorname{diag}(\tau)` ("FB") → ``BlockDiagGaussian``."""

    name = Structure.BLOCK

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        return {"blocks": tuple(exact_blocks(batches()))}

    def dense_blocks(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> list[Tensor]:
        grids = self.layer_taus(tau)
        return [scale * block + torch.diag(grid.reshape(-1)) for block, grid in zip(curvature["blocks"], grids)]

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        return BlockDiagGaussian(*self.blocked(theta), pack(self.dense_blocks(theta, curvature, scale, tau)))


class Kfac(LaplaceStructure):
    r"""Per layer :math:`(\sqrt N G + \sqrt{\tau_l}I)\otimes(\sqrt N A + \sqrt{\tau_l}I)`, Lee et al. eq. 3 →
    ``KroneckerGaussian`` (``kfac_prior: damped``, the paper's).

    Eq. 3 has room for one :math:`\tau_l` per layer only; a layer whose prior differs within it (a bias prior,
    ``bias_prior_precision``) gets the exact :math:`NG\otimes A + I\otimes\operatorname{diag}(t)` (t: the prior of
    each input column, the bias last) in the Kronecker eigenbasis of G and of :math:`T^{-1/2}AT^{-1/2}` →
    ``ScaledEigenKroneckerGaussian``; ``kfac_prior: exact`` uses that form, :math:`NG\otimes A +
    \operatorname{diag}(\tau)`, for every layer (as laplace-torch's KronLaplace)."""

    name = Structure.KFAC

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        return {"factors": kron_factors(batches())}

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        """Eq. 3 as a ``KroneckerGaussian`` where that is exact for every layer, else a ``ScaledEigenKroneckerGaussian``
        with eq. 3's eigenvalues :math:`(\\sqrt Ns_G + \\sqrt\\tau)(\\sqrt Ns_A + \\sqrt\\tau)` in the damped layers and
        :math:`Ns_Gs_{A'} + 1` with scale :math:`t^{1/2}` in the exact ones."""
        factors = curvature["factors"]
        scale = torch.as_tensor(scale, dtype=theta.dtype, device=theta.device)
        grids = self.layer_taus(tau)
        uniform = [bool((grid == grid.reshape(-1)[0]).all()) for grid in grids]
        damped = self.kfac_prior is KfacPrior.DAMPED
        if damped and all(uniform):
            outs, ins = [], []
            for f, grid in zip(factors, grids):
                root = grid.reshape(-1)[0].sqrt()
                outs.append(scale.sqrt() * f.g_factor + root * torch.eye(f.g_factor.shape[0]).to(theta))
                ins.append(scale.sqrt() * f.a_factor + root * torch.eye(f.a_factor.shape[0]).to(theta))
            return KroneckerGaussian(*self.blocked(theta), pack(outs), pack(ins))
        if "bases" not in curvature:  # τ-independent: one eigendecomposition per factor, kept for the next call
            curvature["bases"] = eigenbasis(factors)
        vecs_out, vecs_in, values, scales = [], [], [], []
        for f, basis, grid, uni in zip(factors, curvature["bases"], grids, uniform):
            column = grid[0]  # the prior of each input column (the bias last)
            if not bool((grid == column).all()):
                raise ConfigError(
                    f"laplace: structure=kfac adds the prior as I ⊗ diag(t), one precision per input column, but layer "
                    f"{f.slot.module_index}'s prior varies across its outputs; use one prior per weight and per bias"
                )
            s_g, s_a, u_a = basis.eigvals_out, basis.eigvals_in, basis.eigvecs_in
            root = column.sqrt()
            if uni and damped:
                grid_values = (scale.sqrt() * s_g[:, None] + root[0]) * (scale.sqrt() * s_a[None, :] + root[0])
                root = torch.ones_like(root)
            elif uni:  # N G ⊗ A + τI: no rescaling of A needed
                grid_values = scale * s_g[:, None] * s_a[None, :] + column[0]
                root = torch.ones_like(root)
            else:  # N G ⊗ A + I ⊗ T = (I ⊗ T^½)(N G ⊗ A' + I)(I ⊗ T^½), A' = T^-½ A T^-½
                s_a, u_a = torch.linalg.eigh(f.a_factor / (root[:, None] * root[None, :]))
                s_a = s_a.clamp_min(0.0)
                grid_values = scale * s_g[:, None] * s_a[None, :] + 1.0
            vecs_out.append(basis.eigvecs_out)
            vecs_in.append(u_a)
            values.append(grid_values)
            scales.append(root)
        return ScaledEigenKroneckerGaussian(
            *self.blocked(theta), pack(vecs_out), pack(vecs_in), pack(values), torch.cat(scales)
        )


class Efb(LaplaceStructure):
    r""":math:`(U_G\otimes U_A)(N\Lambda + \tau_l)(U_G\otimes U_A)^\top`, Lee et al. eq. 4 → ``EigenKroneckerGaussian``.

    The eigenvalues are refitted in the Kronecker eigenbasis (George et al. 2018), by a second pass over the data
    (:meth:`second_pass`)."""

    name = Structure.EFB

    def second_pass(self, batches: Batches) -> tuple[tuple[KronEigenbasis, ...], tuple[Tensor, ...], Tensor]:
        """The KFAC eigenbases of pass 1, then the eigenvalues in them (one grid per layer) and the exact diagonal
        ``(D,)`` from pass 2, which runs over pass 1's layer inputs and output gradients kept up to ``cache_mib``
        MiB and recomputes the chunks beyond on pass 1's sampled labels: all from the same Fisher sample."""
        cache = ChunkCache(self.cache_mib * 2**20)
        factors = kron_factors(cache.record(batches()))
        bases = eigenbasis(factors)
        n_chunks = len(cache.labels)
        rest = () if cache.n_cached == n_chunks else batches(cache.n_cached_rows, cache.labels[cache.n_cached :])
        eigs, exact_diag = efb_eigenvalues(rest, bases, cache=cache, progress=self.progress)
        self.info["cached_chunks"] = cache.n_cached
        self.info["curvature_chunks"] = n_chunks
        self.info["curvature_cache_mib"] = cache.nbytes / 2**20
        return bases, eigs, exact_diag

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        bases, eigs, _ = self.second_pass(batches)
        return {"bases": bases, "eigs": eigs}

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        values = []
        for e, grid, slot in zip(curvature["eigs"], self.layer_taus(tau), self.layout.slots):
            flat = grid.reshape(-1)  # one prior precision per layer, added to the eigenvalues (graph kept)
            if not bool((flat == flat[0]).all()):
                raise ConfigError(
                    f"laplace: structure={self.name.value} needs one prior precision per layer, but layer "
                    f"{slot.module_index} has {sorted(set(flat.tolist()))}; set method.prior_precision=<τ>, "
                    "bias_prior_precision=null or method.structure=kfac (which handles a bias prior exactly)"
                )
            values.append(scale * e + flat[0])
        bases = curvature["bases"]
        vecs_out, vecs_in = pack([b.eigvecs_out for b in bases]), pack([b.eigvecs_in for b in bases])
        return EigenKroneckerGaussian(*self.blocked(theta), vecs_out, vecs_in, pack(values))

    def dense_blocks(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> list[Tensor]:
        r""":math:`V(N\Lambda)V^\top + \operatorname{diag}(\tau_l)` per layer, :math:`V = U_G\otimes U_A`."""
        blocks = []
        for basis, e, grid in zip(curvature["bases"], curvature["eigs"], self.layer_taus(tau)):
            v = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
            blocks.append((v * (scale * e).reshape(-1)) @ v.mT + torch.diag(grid.reshape(-1)))
        return blocks


def layer_rank(low: Any) -> dict[str, Any]:
    """One row of ``def_ranks.csv`` (DEF Table 2): the layer's position and kind, its block's shape m x n (n with
    the bias column), its weight count (the paper's N: weights only), and the kept grid g x a = L."""
    slot = low.slot
    m, n = low.factor_out.shape[0], low.factor_in.shape[0]
    g, a = low.eigenvalues.shape
    return {
        "module_index": slot.module_index,
        "kind": "linear" if slot.conv is None else "conv",
        "m": m,
        "n": n,
        "n_weights": slot.out_features * slot.in_features,
        "n_block": m * n,
        "g": g,
        "a": a,
        "kept_rank": g * a,
    }


class Def(Efb):
    r""":math:`(U_{G,1:g}\otimes U_{A,1:a})(N\Lambda_{1:L})(\cdot)^\top + \operatorname{diag}(N D + \tau)`, Lee et al.
    eq. 9 → ``KroneckerLowRankPlusDiagGaussian``.

    Alg. 1 keeps the top ``rank`` eigenvalues per layer (``None``: all) of EFB's second pass, and D is the diagonal
    correction of eq. 5. D may be negative (the exact diagonal is below that of the kept low-rank part; Lemma 3's
    sufficient condition D > 0 fails); the precision stays positive definite, with the exact diagonal, as long as
    :math:`ND + \tau > 0`. Where that fails D is clipped at 0 (prec_diag = τ there; the clipping Lee et al.
    recommend), and ``info["n_clipped"]`` counts the entries."""

    name = Structure.DEF

    def curvature(self, theta: Tensor, batches: Batches) -> dict[str, Any]:
        bases, eigs, exact_diag = self.second_pass(batches)
        lows, corrections = [], torch.zeros_like(theta)
        for basis, e in zip(bases, eigs):
            low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, e, self.rank)
            if low.rank > MAX_DEF_RANK:
                raise ConfigError(
                    f"laplace: DEF keeps L={low.rank} eigenvalues in layer {low.slot.module_index} (Alg. 1 keeps "
                    f"whole rows and columns of the top K={self.rank}); its L x L sampler core is too large "
                    f"(limit {MAX_DEF_RANK}): lower method.rank"
                )
            lows.append(low)
            correction = diagonal_correction(flat_to_grid(exact_diag, basis.slot), low)
            corrections[block_index(basis.slot, theta.device)] = correction.reshape(-1)
        self.info["kept_rank"] = sum(low.rank for low in lows)
        self.layer_ranks = [layer_rank(low) for low in lows]
        return {"lows": lows, "corrections": corrections}

    def prec_diag(self, curvature: dict[str, Any], scale: Any, tau: Tensor) -> Tensor:
        r""":math:`ND + \tau` in flat order, τ where that is not positive (D clipped at 0)."""
        prec_diag = scale * curvature["corrections"] + tau
        invalid = prec_diag <= 0
        n_clipped = self.info["n_clipped"] = int(invalid.sum())
        if n_clipped:
            logger.info("laplace def: %d entries with N·D + τ <= 0 set to τ (D clipped at 0; Lemma 3)", n_clipped)
        return torch.where(invalid, tau, prec_diag)

    def assemble(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> StructuredGaussian:
        lows = curvature["lows"]
        return KroneckerLowRankPlusDiagGaussian(
            *self.blocked(theta),
            torch.tensor([list(low.eigenvalues.shape) for low in lows], device=theta.device),
            pack([low.factor_out for low in lows]),
            pack([low.factor_in for low in lows]),
            pack([scale * low.eigenvalues for low in lows]),
            self.prec_diag(curvature, scale, tau),
        )

    def dense_blocks(self, theta: Tensor, curvature: dict[str, Any], scale: Any, tau: Tensor) -> list[Tensor]:
        r"""Eq. 9 per layer, :math:`WW^\top + \operatorname{diag}(ND + \tau)` with :math:`W = (U_{G,1:g}\otimes
        U_{A,1:a})(N\Lambda_{1:L})^{1/2}`; the diagonal may hold zeros where τ = 0."""
        prec_diag, blocks = self.prec_diag(curvature, scale, tau), []
        for low in curvature["lows"]:
            w = torch.kron(low.factor_out, low.factor_in) * (scale * low.eigenvalues).sqrt().reshape(-1)
            blocks.append(w @ w.mT + torch.diag(prec_diag[block_index(low.slot, theta.device)]))
        return blocks


STRUCTURES: dict[Structure, type[LaplaceStructure]] = {cls.name: cls for cls in (Diag, Kfac, Efb, Def, Block, Full)}

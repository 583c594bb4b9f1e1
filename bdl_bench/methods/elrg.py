r"""ELRG-VI: Gaussian VI with a low-rank-plus-diagonal covariance per layer (Tomczak et al. 2020).

Each layer's parameters :math:`\theta_l = (\operatorname{vec} W_l, b_l) \in \mathbb R^{D_l}` get

.. math::

    q(\theta_l) = \mathcal N\Bigl(\mu_l,\; \alpha \sum_{k=1}^K v_{l,k} v_{l,k}^\top + \operatorname{diag}(\sigma_l^2)\Bigr),
    \qquad \alpha = 1/K,

a *covariance* of rank K plus a diagonal (Tomczak et al. 2020, Sec. 3; α = 1/K as in the paper). With
``learn_diag: false`` (ELRG-VI, the paper's main variant) the diagonal is the constant
:math:`\sigma^2 = ` ``init_std``² for every parameter; with ``learn_diag: true`` (ELRG-D-VI) it is learned as
:math:`\sigma = \operatorname{softplus}(\rho)`, initialised at ``init_std``.

**Forward pass (Lemma 1).** For a linear layer :math:`F_\theta(x) = x W^\top + b`, writing :math:`F_v` for
the layer with its weight and bias replaced by the corresponding parts of v,

.. math::

    F_\theta(x) \overset{d}{=} F_\mu(x) + \sqrt\alpha \sum_{k=1}^K \epsilon_k F_{v_k}(x)
        + \epsilon \odot \sqrt{F_{\sigma^2}(x^2)}, \qquad \epsilon_k \sim \mathcal N(0, 1),\;
        \epsilon \sim \mathcal N(0, I),

drawn independently per example. The K products :math:`F_{v_k}(x)` are one matrix product with a
``(K·out, in)`` weight, so a step costs (1 + K) layer-sized products forward, plus one for
:math:`F_{\sigma^2}(x^2)` when the diagonal is learned; with the constant diagonal it is
:math:`\sigma^2 (\lVert x\rVert^2 + 1)` for every output, no product at all.

**KL (Lemma 2, via the matrix determinant lemma).** Against the prior
:math:`\mathcal N(0, \operatorname{diag}\lambda^{-1})` (the paper states it for :math:`\lambda = 1/\gamma`
constant; the per-parameter form is the same derivation), with :math:`V = [v_1 \dots v_K]`
(:func:`elrg_kl`):

.. math::

    \mathrm{KL} = \tfrac12\Bigl[\sum_d \lambda_d\bigl(\sigma_d^2 + \alpha \textstyle\sum_k v_{dk}^2 + \mu_d^2\bigr)
        - D - \sum_d \log\lambda_d - \sum_d \log\sigma_d^2
        - \log\bigl|I_K + \alpha V^\top \operatorname{diag}(\sigma^{-2}) V\bigr|\Bigr],

:math:`O(K^2 D_l + K^3)` per layer instead of :math:`O(D_l^3)`.

Initialisation (as the authors' code ``marctom/elrgvi``): :math:`\mu` = the model's weights,
:math:`v_k` = ``0.5·std(W_l)/√K`` times standard normals for the weight part and ``0.01`` times standard
normals for the bias part, drawn from the problem's generator. The gradient SNR tracked with
``snr_window`` is that of the weights' :math:`v_k` (and :math:`\rho` when learned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.methods._layerwise_vi import Layer, LayerwiseVI, check_positive_int, sqrt_or_tiny
from bdl_bench.methods.base import register_method
from bdl_bench.methods.bbb import softplus_inverse, standard_normal

_BIAS_FACTOR_SCALE = 0.01  # initial scale of the bias part of v_k (authors' code)


@dataclass
class _Block:
    """One block of coordinates of a layer (its weights, or its bias) inside :class:`_LowRankCovKL`."""

    mean: Tensor  # (D_b,)
    factor: Tensor  # (K, D_b)
    diag: Tensor | float  # (D_b,) or constant
    lam: Tensor | float  # (D_b,) or constant
    scaled: Tensor | None = None  # factor / diag when diag is a tensor
    lam_factor: Tensor | None = None
    lam_mean: Tensor | None = None


class _LowRankCovKL(torch.autograd.Function):
    """Lemma 2's KL over blocks that share one low-rank term, with a hand-written backward (:func:`elrg_kl`).

    Returns the KL and every block's factor (a view of it): a caller that runs the network on those
    views gets the network's gradient of a factor and the KL's summed in one product here
    (``addmm``), rather than by autograd's accumulation of two factor-sized tensors.
    """

    @staticmethod
    def forward(ctx: Any, alpha: float, *args: Any) -> tuple[Tensor, ...]:
        blocks = [_Block(*args[i : i + 4]) for i in range(0, len(args), 4)]
        first = blocks[0].factor
        rank = first.shape[0]
        gram = torch.zeros(rank, rank, dtype=first.dtype, device=first.device)
        total = torch.zeros((), dtype=first.dtype, device=first.device)
        for b in blocks:
            dim = b.mean.numel()
            if isinstance(b.diag, Tensor):
                b.scaled = b.factor / b.diag  # V^T C^{-1}
                gram = gram + b.scaled @ b.factor.T
                trace_diag = torch.dot(b.lam, b.diag) if isinstance(b.lam, Tensor) else b.lam * b.diag.sum()
                logdet_diag = torch.log(b.diag).sum()
            else:
                gram = gram + (b.factor @ b.factor.T) / b.diag
                trace_diag = b.diag * (b.lam.sum() if isinstance(b.lam, Tensor) else b.lam * dim)
                logdet_diag = dim * math.log(b.diag)
            flat = b.factor.reshape(-1)
            if isinstance(b.lam, Tensor):
                b.lam_factor, b.lam_mean = b.factor * b.lam, b.mean * b.lam
                trace_low, maha = torch.dot(b.lam_factor.reshape(-1), flat), torch.dot(b.lam_mean, b.mean)
                log_lam = torch.log(b.lam).sum()
            else:
                trace_low, maha = b.lam * torch.dot(flat, flat), b.lam * torch.dot(b.mean, b.mean)
                log_lam = dim * math.log(b.lam)
            total = total + trace_diag + alpha * trace_low + maha - dim - log_lam - logdet_diag
        eye = torch.eye(rank, dtype=first.dtype, device=first.device)
        chol = torch.linalg.cholesky(eye + alpha * gram)
        gram_inv = torch.cholesky_inverse(chol)  # G^{-1}, (K, K)
        logdet_gram = 2.0 * torch.log(torch.diagonal(chol)).sum()
        # the blocks (inputs and intermediates) are kept on ctx rather than through save_for_backward,
        # which takes a flat tuple of tensors; the inputs are leaves or views that nothing changes in place
        ctx.alpha, ctx.blocks = alpha, blocks
        ctx.gram_inv = gram_inv
        return (0.5 * (total - logdet_gram), *(b.factor.view_as(b.factor) for b in blocks))

    @staticmethod
    def backward(ctx: Any, g: Tensor | None, *g_factor_outs: Tensor | None) -> tuple[Tensor | None, ...]:
        alpha, gram_inv = ctx.alpha, ctx.gram_inv
        grads: list[Tensor | None] = [None]
        if g is None:  # only the factors' pass-through is differentiated
            for i, g_out in enumerate(g_factor_outs):
                grads += [None, g_out if ctx.needs_input_grad[2 + 4 * i] else None, None, None]
            return tuple(grads)
        for i, (b, g_out) in enumerate(zip(ctx.blocks, g_factor_outs)):
            need_mean, need_factor, need_diag = ctx.needs_input_grad[1 + 4 * i : 4 + 4 * i]
            g_mean = g_factor = g_diag = None
            if need_mean:  # lambda mu
                g_mean = b.lam_mean * g if b.lam_mean is not None else b.mean * (b.lam * g)
            if need_factor:  # alpha (lambda V - G^{-1} V C^{-1})
                if b.scaled is None and b.lam_factor is None:  # one (K, K) x (K, D_b) product
                    eye = torch.eye(gram_inv.shape[0], dtype=gram_inv.dtype, device=gram_inv.device)
                    coef = (b.lam * eye - gram_inv / b.diag) * (alpha * g)
                    # + the pass-through's gradient, in the same product
                    g_factor = coef @ b.factor if g_out is None else torch.addmm(g_out, coef, b.factor)
                else:
                    ginv_scaled = gram_inv @ (b.scaled if b.scaled is not None else b.factor / b.diag)
                    g_factor = (b.lam_factor if b.lam_factor is not None else b.lam * b.factor) - ginv_scaled
                    g_factor.mul_(alpha * g)
                    if g_out is not None:
                        g_factor.add_(g_out)
            if need_diag and b.scaled is not None:  # (lambda - 1/c + alpha diag(C^-1 V G^-1 V^T C^-1)) / 2
                curvature = (gram_inv @ b.scaled).mul_(b.scaled).sum(0)
                g_diag = curvature.mul_(alpha).sub_(b.diag.reciprocal()).add_(b.lam).mul_(0.5 * g)
            grads += [g_mean, g_factor, g_diag, None]
        return tuple(grads)


def elrg_kl_blocks(blocks: list[tuple[Tensor, Tensor, Tensor | float, Tensor | float]], alpha: float) -> Tensor:
    """:func:`elrg_kl` of a Gaussian whose coordinates come in blocks ``(mean, factor, diag, prior_precision)``
    (e.g. a layer's weights and its bias), without concatenating them: the Gram matrix is a sum over blocks."""
    return _LowRankCovKL.apply(float(alpha), *(x for block in blocks for x in block))[0]


def _elrg_kl_blocks_with_factors(
    blocks: list[tuple[Tensor, Tensor, Tensor | float, Tensor | float]], alpha: float
) -> tuple[Tensor, ...]:
    """:func:`elrg_kl_blocks` and each block's factor as a view whose gradient joins the KL's in one product."""
    return _LowRankCovKL.apply(float(alpha), *(x for block in blocks for x in block))


def elrg_kl(
    mean: Tensor,
    cov_factor: Tensor,
    cov_diag: Tensor | float,
    prior_precision: Tensor | float,
    alpha: float,
) -> Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(\mu, \alpha V V^\top + \operatorname{diag} c) \,\|\, \mathcal N(0, \operatorname{diag}\lambda^{-1}))`
    by the matrix determinant lemma (Tomczak et al. 2020, Lemma 2; see the module docstring).

    The backward is written by hand (as the forward's cost, :math:`O(K^2 D)`): with
    :math:`G = I_K + \alpha V^\top C^{-1} V`,
    :math:`\partial/\partial\mu = \lambda\mu`, :math:`\partial/\partial V = \alpha(\lambda \circ V - C^{-1} V G^{-1})`
    and :math:`\partial/\partial c_d = \tfrac12(\lambda_d - 1/c_d + \alpha\, v_d^\top G^{-1} v_d / c_d^2)`
    (:math:`v_d` the d-th row of V).

    Args:
        mean: :math:`\mu`, ``(D,)``.
        cov_factor: :math:`V^\top`, ``(K, D)`` (row k is :math:`v_k`).
        cov_diag: the diagonal variances :math:`c > 0`, ``(D,)``, or one number for all.
        prior_precision: :math:`\lambda > 0`, ``(D,)``, or one number for all.
        alpha: :math:`\alpha > 0`.

    Returns:
        A scalar tensor, differentiable in every tensor argument.
    """
    return elrg_kl_blocks([(mean, cov_factor, cov_diag, prior_precision)], alpha)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  learned sigma^2, or None for the constant diagonal
    var_parts: list[Tensor] | None
    kl: Tensor | None
    factors: dict[int, tuple[Tensor, Tensor | None]] | None = None  # layer index -> its v_k to run on
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (one split per step)


@register_method("elrg")
class EfficientLowRankGaussianVI(LayerwiseVI):
    """ELRG-(D-)VI (see the module docstring).

    Args:
        rank: K, the rank of each layer's low-rank covariance term.
        learn_diag: ``False``: constant diagonal ``init_std``² (ELRG-VI); ``True``: learned (ELRG-D-VI).
        lr: Adam learning rate.
        n_train_mc_samples: MC samples S per training step.
        init_std: the diagonal's standard deviation (constant, or initial when learned).
        kl_annealing_steps: steps of linear KL annealing (0: none).
        snr_window: steps per gradient-SNR window of the weights' :math:`v_k` (0: off).

    Raises:
        ValueError: if ``rank`` is not an integer >= 1 (at construction) or exceeds the number of
            parameters :math:`D_l` of some linear layer (at ``setup``), if ``learn_diag`` is not a bool,
            on the options ``gmfvi`` refuses, and (at ``setup``) naming the layer, on a model with a
            parametrised module other than ``nn.Linear`` (ELRG is implemented for dense layers only).
    """

    supported_layers = (nn.Linear,)

    def __init__(
        self,
        *,
        rank: int,
        learn_diag: bool,
        lr: float,
        n_train_mc_samples: int,
        init_std: float,
        kl_annealing_steps: int,
        snr_window: int,
    ) -> None:
        self.rank = check_positive_int("elrg", "rank", rank)
        if not isinstance(learn_diag, bool):
            raise ValueError(f"elrg: learn_diag must be true or false, got {learn_diag!r}")
        self.learn_diag = learn_diag
        self.alpha = 1.0 / self.rank
        super().__init__(
            lr=lr,
            n_train_mc_samples=n_train_mc_samples,
            init_std=init_std,
            kl_annealing_steps=kl_annealing_steps,
            snr_window=snr_window,
        )

    def _init_variational(self) -> dict[str, Tensor]:
        smallest = min(self.layers, key=lambda layer: layer.n_params)
        if self.rank > smallest.n_params:
            raise ValueError(
                f"elrg: rank={self.rank} exceeds the {smallest.n_params} parameters of linear layer"
                f" {smallest.index} ({smallest.in_features}→{smallest.out_features}); choose"
                f" 1 <= rank <= {smallest.n_params}"
            )
        g, K = self.problem.generator, self.rank
        means = self.split_params(self.mean.detach())
        self.layer_offsets = []
        self.param_prior: dict[int, Tensor | float] = {}
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            start = sum(self.param_sizes[: layer.weight_param])
            self.layer_offsets.append(start)
            scale = 0.5 * float(means[layer.weight_param].std(correction=0)) / math.sqrt(K)
            shape = (K, layer.out_features, layer.in_features)
            tensors[f"v_weight{layer.index}"] = scale * standard_normal(shape, g, self.mean)
            if layer.bias_param is not None:
                shape_b = (K, layer.out_features)
                tensors[f"v_bias{layer.index}"] = _BIAS_FACTOR_SCALE * standard_normal(shape_b, g, self.mean)
            # per parameter tensor: one number when the prior precision is constant on it (the usual case)
            for index in (layer.weight_param, layer.bias_param):
                if index is not None:
                    lam = self.split_params(self.prior_precision)[index]
                    self.param_prior[index] = float(lam.flatten()[0]) if bool((lam == lam.flatten()[0]).all()) else lam
        if self.learn_diag:
            tensors["rho"] = softplus_inverse(torch.full_like(self.mean, self.init_std))
        for t in tensors.values():
            t.requires_grad_(True)
        return tensors

    def _factor(self, layer: Layer) -> tuple[Tensor, Tensor | None]:
        """The weight and bias parts of the layer's :math:`v_k`: ``(K, out, in)`` and ``(K, out)`` or ``None``."""
        return self.variational[f"v_weight{layer.index}"], self.variational.get(f"v_bias{layer.index}")

    def layer_cov_factor(self, layer: Layer) -> Tensor:
        """:math:`V_l^\\top = [v_1 \\dots v_K]^\\top` in the layer's flat order (weight, then bias): ``(K, D_l)``."""
        v_weight, v_bias = self._factor(layer)
        return torch.cat([v_weight.flatten(1)] + ([] if v_bias is None else [v_bias]), dim=1)

    def layer_cov_diag(self, layer: Layer, var: Tensor | None = None) -> Tensor | float:
        """The diagonal variances of layer ``layer``: ``(D_l,)`` when learned, else one number."""
        if not self.learn_diag:
            return self.init_std**2
        var = var if var is not None else F.softplus(self.variational["rho"]).square()
        return var.narrow(0, self.layer_offsets[layer.index - 1], layer.n_params)

    def _step_terms(self, with_kl: bool) -> _Terms:
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        kl = None
        if with_kl:
            means = self.mean_parts()  # shared with the network: one gradient gather for the mean
            diags = self.split_params(var) if var is not None else None
            terms = []
            factors = {}
            for layer in self.layers:
                blocks = []
                for index, factor in zip((layer.weight_param, layer.bias_param), self._factor(layer)):
                    if index is not None:
                        diag = diags[index].flatten() if diags is not None else self.init_std**2
                        lam = self.param_prior[index]
                        lam = lam.flatten() if isinstance(lam, Tensor) else lam
                        blocks.append((means[index].flatten(), factor.flatten(1), diag, lam))
                layer_kl, *outs = _elrg_kl_blocks_with_factors(blocks, self.alpha)
                terms.append(layer_kl)
                factors[layer.index] = (outs[0], outs[1] if len(outs) > 1 else None)
            kl = torch.stack(terms).sum()
            var_parts = None if var is None else self.split_params(var)
            return _Terms(var=var, var_parts=var_parts, kl=kl, factors=factors, mean_parts=means)
        return _Terms(var=var, var_parts=None if var is None else self.split_params(var), kl=kl)

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        g, K, out = self.problem.generator, self.rank, layer.out_features
        # the KL's pass-through views of v_k when there are (their gradient joins the KL's in one product)
        v_weight, v_bias = terms.factors[layer.index] if terms.factors is not None else self._factor(layer)
        mean = F.linear(a, weight_mean, bias_mean)  # F_mu(x)
        # the K products F_{v_k}(x) as one product with a (K*out, in) weight
        low = F.linear(a, v_weight.view(K * out, -1), None if v_bias is None else v_bias.view(K * out))
        low = low.unflatten(-1, (K, out))  # (..., K, out)
        eps_k = standard_normal((*mean.shape[:-1], 1, K), g, mean)
        h = mean + math.sqrt(self.alpha) * (eps_k @ low).squeeze(-2)
        a2 = a * a
        if terms.var_parts is not None:  # F_{sigma^2}(x^2)
            bias_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
            var = F.linear(a2, terms.var_parts[layer.weight_param], bias_var)
        else:  # constant sigma^2: sigma^2 (|x|^2 + 1) for every output
            var = self.init_std**2 * (a2.sum(-1, keepdim=True) + (0.0 if layer.bias_param is None else 1.0))
        eps = standard_normal(tuple(mean.shape), g, mean)
        return h + sqrt_or_tiny(var) * eps

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        g = self.problem.generator
        parts: list[Tensor] = [torch.empty(0)] * len(self.param_sizes)
        for layer in self.layers:
            eps_k = standard_normal((n_samples, self.rank), g, self.mean)
            low = math.sqrt(self.alpha) * eps_k @ self.layer_cov_factor(layer)  # (S, D_l)
            parts[layer.weight_param] = low[:, : layer.n_weights]
            if layer.bias_param is not None:
                parts[layer.bias_param] = low[:, layer.n_weights :]
        low_all = torch.cat(parts, dim=1)
        eps = standard_normal((n_samples, self.mean.numel()), g, self.mean)
        diag_std = sqrt_or_tiny(terms.var) if terms.var is not None else self.init_std
        return self.mean + low_all + diag_std * eps

    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        v_weight = self._factor(layer)[0]
        grads = [v_weight.grad if v_weight.grad is not None else torch.zeros_like(v_weight)]
        if self.learn_diag:
            rho = self.variational["rho"]
            grad = rho.grad if rho.grad is not None else torch.zeros_like(rho)
            grads.append(self.split_params(grad)[layer.weight_param])
        return grads

    @torch.no_grad()
    def marginal_std(self) -> Tensor:
        """Each parameter's posterior standard deviation :math:`\\sqrt{c_d + \\alpha\\sum_k v_{dk}^2}`, ``(D,)``."""
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        blocks = []
        for layer in self.layers:
            low = self.alpha * self.layer_cov_factor(layer).square().sum(0)
            blocks.append(low + self.layer_cov_diag(layer, var))
        return torch.cat(blocks).sqrt()

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
(:func:`~bdl_bench.kernels.elrg_kl.elrg_kl_blocks`):

.. math::

    \mathrm{KL} = \tfrac12\Bigl[\sum_d \lambda_d\bigl(\sigma_d^2 + \alpha \textstyle\sum_k v_{dk}^2 + \mu_d^2\bigr)
        - D - \sum_d \log\lambda_d - \sum_d \log\sigma_d^2
        - \log\bigl|I_K + \alpha V^\top \operatorname{diag}(\sigma^{-2}) V\bigr|\Bigr],

:math:`O(K^2 D_l + K^3)` per layer instead of :math:`O(D_l^3)`.

**Cost.** Beyond the (1 + K) layer products, fresh factor-sized or ``(D,)`` tensors cost more than passes over
them (each is faulted in anew), so a training step runs through hand-written backwards in reused buffers
(:mod:`bdl_bench.kernels.elrg_terms`): :class:`ElrgTerms` (the KL and the parts the network runs on) and
:class:`LowRankLocalLinear` (a dense layer by Lemma 1, its gradients written into the buffers). Evaluation
takes the plain autograd route.

Initialisation (as the authors' code ``marctom/elrgvi``): :math:`\mu` = the model's weights,
:math:`v_k` = ``0.5·std(W_l)/√K`` times standard normals for the weight part and ``0.01`` times standard
normals for the bias part, drawn from the problem's generator. The gradient SNR tracked with
``snr_window`` is that of the weights' :math:`v_k` (and :math:`\rho` when learned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.curvature.gram import workspace_buffer
from bdl_bench.errors import ConfigError
from bdl_bench.kernels.buffers import reusable_grad_buffer
from bdl_bench.kernels.elrg_kl import elrg_kl_blocks
from bdl_bench.kernels.elrg_terms import (
    ElrgTerms,
    LowRankLocalLinear,
    StepBuffers,
    TermsPlan,
    low_rank_local_linear_reference,
)
from bdl_bench.methods._diag_vi import softplus_inverse, sqrt_or_tiny, standard_normal, uniform_value
from bdl_bench.methods._layerwise_vi import Layer, LayerwiseVI, base_options
from bdl_bench.methods.base import register_method
from bdl_bench.ranges import COUNT

_BIAS_FACTOR_SCALE = 0.01  # initial scale of the bias part of v_k (authors' code)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  learned sigma^2, or None for the constant diagonal
    var_parts: list[Tensor] | None
    kl: Tensor | None
    factors: dict[int, tuple[Tensor, Tensor | None]] | None = None  # layer index -> its v_k to run on
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (one split per step)
    into: dict[int, tuple[Tensor | None, ...]] | None = None  # layer index -> where its gradients go


@register_method("elrg")
class EfficientLowRankGaussianVI(LayerwiseVI):
    """ELRG-(D-)VI (see the module docstring), for dense layers only."""

    supported_layers = (nn.Linear,)
    option_ranges = MappingProxyType({**LayerwiseVI.option_ranges, "rank": COUNT})

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
        record_every: int = 0,
    ) -> None:
        self.keep_options(locals())
        if not isinstance(learn_diag, bool):
            raise ConfigError(f"elrg: learn_diag must be true or false, got {learn_diag!r}")
        self.learn_diag = learn_diag
        self.alpha = 1.0 / self.rank
        super().__init__(**base_options(locals()))

    def _init_variational(self) -> dict[str, Tensor]:
        smallest = min(self.layers, key=lambda layer: layer.n_params)
        if self.rank > smallest.n_params:
            raise ConfigError(
                f"elrg: rank={self.rank} exceeds the {smallest.n_params} parameters of linear layer"
                f" {smallest.index} ({smallest.in_features}→{smallest.out_features}); choose"
                f" 1 <= rank <= {smallest.n_params}"
            )
        g, K = self.problem.generator, self.rank
        means = self.split_params(self.mean.detach())
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            scale = 0.5 * float(means[layer.weight_param].std(correction=0)) / math.sqrt(K)
            shape = (K, layer.out_features, layer.in_features)
            tensors[f"v_weight{layer.index}"] = scale * standard_normal(shape, g, self.mean)
            if layer.bias_param is not None:
                shape_b = (K, layer.out_features)
                tensors[f"v_bias{layer.index}"] = _BIAS_FACTOR_SCALE * standard_normal(shape_b, g, self.mean)
        # lambda per parameter position, flat, or one number where it is constant on the parameter (the usual case)
        lam = self.split_params(self.prior_precision)
        self._flat_prior = {i: uniform_value(lam[i].flatten()) for layer in self.layers for i in layer.params.values()}
        if self.learn_diag:
            tensors["rho"] = softplus_inverse(torch.full_like(self.mean, self.init_std))
        for t in tensors.values():
            t.requires_grad_(True)
        self._factor_names = [name for name in tensors if name.startswith("v_")]
        self._kl_blocks = []  # per layer: (parameter position, factor position) of its weight and bias
        for layer in self.layers:
            kinds = [("weight", layer.weight_param), ("bias", layer.bias_param)]
            names = [(p, f"v_{kind}{layer.index}") for kind, p in kinds if p is not None]
            self._kl_blocks.append([(p, self._factor_names.index(name)) for p, name in names])
        flat = [torch.empty_like(self.mean) for _ in range(4 if self.learn_diag else 0)]
        self._buffers = StepBuffers(
            torch.empty_like(self.mean), [torch.empty_like(tensors[n]) for n in self._factor_names], *flat
        )
        return tensors

    def _factor(self, layer: Layer) -> tuple[Tensor, Tensor | None]:
        """The weight and bias parts of the layer's :math:`v_k`: ``(K, out, in)`` and ``(K, out)`` or ``None``."""
        return self.variational[f"v_weight{layer.index}"], self.variational.get(f"v_bias{layer.index}")

    def layer_cov_factor(self, layer: Layer) -> Tensor:
        """:math:`V_l^\\top = [v_1 \\dots v_K]^\\top` in the layer's flat order (weight, then bias): ``(K, D_l)``."""
        v_weight, v_bias = self._factor(layer)
        return torch.cat([v_weight.flatten(1)] + ([] if v_bias is None else [v_bias]), dim=1)

    def _step_terms(self, with_kl: bool) -> _Terms:
        if with_kl and self.local and torch.is_grad_enabled():  # a training step
            return self._fused_terms()
        return self._plain_terms(with_kl)

    def _plain_terms(self, with_kl: bool) -> _Terms:
        """The per-step terms by plain autograd (the twin of :meth:`_fused_terms`)."""
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        kl = means = None
        if with_kl:  # kl_to_prior, or a training step that draws whole parameter vectors
            means = self.mean_parts()  # shared with the network
            diags = self.split_params(var) if var is not None else None
            terms = []
            for layer in self.layers:
                blocks = []
                for index, factor in zip((layer.weight_param, layer.bias_param), self._factor(layer)):
                    if index is not None:
                        diag = diags[index].flatten() if diags is not None else self.init_std**2
                        blocks.append((means[index].flatten(), factor.flatten(1), diag, self._flat_prior[index]))
                terms.append(elrg_kl_blocks(blocks, self.alpha))
            kl = torch.stack(terms).sum()
        return _Terms(var=var, var_parts=None if var is None else self.split_params(var), kl=kl, mean_parts=means)

    def _fused_terms(self) -> _Terms:
        """The KL and the parts the network runs on, through :class:`ElrgTerms`; each layer's ``into`` are
        the parts of this step's gradient buffers that :class:`LowRankLocalLinear` writes into."""
        buffers = self._buffers
        factors = [self.variational[name] for name in self._factor_names]
        rho = self.variational.get("rho")
        # the gradients' buffers, unless a leaf's .grad is one of them (a backward that accumulates)
        grad_mean = reusable_grad_buffer(self.mean, buffers.grad_mean)
        grad_factors = [reusable_grad_buffer(f, buf) for f, buf in zip(factors, buffers.grad_factors)]
        grad_rho = None if rho is None else reusable_grad_buffer(rho, buffers.grad_rho)
        plan = TermsPlan(
            alpha=self.alpha,
            shapes=self.param_shapes,
            layers=self._kl_blocks,
            prior=self._flat_prior,
            const_var=None if self.learn_diag else self.init_std**2,
            grad_mean=grad_mean,
            grad_factors=grad_factors,
            grad_rho=grad_rho,
            buffers=buffers,
        )
        kl, *outs = ElrgTerms.apply(plan, self.mean, rho, *factors)
        n_params, n_factors = len(self.param_shapes), len(factors)
        mean_parts, var_parts = outs[:n_params], outs[n_params + n_factors :]
        by_name = dict(zip(self._factor_names, outs[n_params : n_params + n_factors]))
        grads_by_name = dict(zip(self._factor_names, grad_factors))
        mean_grads = self.split_params(grad_mean)
        var_grads = None if grad_rho is None else self.split_params(grad_rho)
        factor_views, into = {}, {}
        for layer in self.layers:
            w, b, i = layer.weight_param, layer.bias_param, layer.index
            factor_views[i] = (by_name[f"v_weight{i}"], by_name.get(f"v_bias{i}"))
            into[i] = (
                mean_grads[w],
                None if b is None else mean_grads[b],
                grads_by_name[f"v_weight{i}"],
                grads_by_name.get(f"v_bias{i}"),
                None if var_grads is None else var_grads[w],
                None if var_grads is None or b is None else var_grads[b],
            )
        return _Terms(None, var_parts or None, kl, factors=factor_views, mean_parts=mean_parts, into=into)

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        """Lemma 1's sample: with the hand-written backward in a training step, else by plain autograd."""
        g, K, out = self.problem.generator, self.rank, layer.out_features
        eps_k = standard_normal((*a.shape[:-1], 1, K), g, a)
        eps = standard_normal((*a.shape[:-1], out), g, a)
        w_var = b_var = None
        if terms.var_parts is not None:
            w_var = terms.var_parts[layer.weight_param]
            b_var = None if layer.bias_param is None else terms.var_parts[layer.bias_param]
        const_var = None if self.learn_diag else self.init_std**2
        if terms.into is None:
            v_weight, v_bias = self._factor(layer)
            return low_rank_local_linear_reference(
                a, weight_mean, bias_mean, v_weight, v_bias, w_var, b_var, const_var, eps_k, eps, self.alpha
            )
        v_weight, v_bias = terms.factors[layer.index]
        shape = (a.numel() // a.shape[-1], K * out)  # (rows, K·out)
        temps = [workspace_buffer(self._buffers.temps, f"{r}{layer.index}", shape, a) for r in ("low", "grad")]
        coef = math.sqrt(self.alpha) * eps_k
        return LowRankLocalLinear.apply(
            a, weight_mean, bias_mean, v_weight, v_bias, w_var, b_var, coef, eps, const_var,
            terms.into[layer.index], temps,
        )  # fmt: skip

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

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

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.methods._layerwise_vi import LayerwiseVI, LinearLayer, check_positive_int, sqrt_or_tiny
from bdl_bench.methods.base import register_method
from bdl_bench.methods.bbb import softplus_inverse, standard_normal

_BIAS_FACTOR_SCALE = 0.01  # initial scale of the bias part of v_k (authors' code)


def elrg_kl(
    mean: Tensor,
    cov_factor: Tensor,
    cov_diag: Tensor | float,
    prior_precision: Tensor | float,
    alpha: float,
) -> Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(\mu, \alpha V V^\top + \operatorname{diag} c) \,\|\, \mathcal N(0, \operatorname{diag}\lambda^{-1}))`
    by the matrix determinant lemma (Tomczak et al. 2020, Lemma 2; see the module docstring).

    Args:
        mean: :math:`\mu`, ``(D,)``.
        cov_factor: :math:`V^\top`, ``(K, D)`` (row k is :math:`v_k`).
        cov_diag: the diagonal variances :math:`c > 0`, ``(D,)``, or one number for all.
        prior_precision: :math:`\lambda > 0`, ``(D,)``, or one number for all.
        alpha: :math:`\alpha > 0`.

    Returns:
        A scalar tensor, differentiable in every tensor argument.
    """
    dim, rank = mean.numel(), cov_factor.shape[0]
    lam = prior_precision
    if isinstance(cov_diag, Tensor):
        trace_diag = torch.dot(lam, cov_diag) if isinstance(lam, Tensor) else lam * cov_diag.sum()
        logdet_diag = torch.log(cov_diag).sum()
        gram = (cov_factor / cov_diag) @ cov_factor.T
    else:
        trace_diag = cov_diag * (lam.sum() if isinstance(lam, Tensor) else lam * dim)
        logdet_diag = dim * math.log(cov_diag)
        gram = (cov_factor @ cov_factor.T) / cov_diag
    if isinstance(lam, Tensor):
        trace_low = (cov_factor.square() * lam).sum()
        maha = torch.dot(lam * mean, mean)
        log_lam = torch.log(lam).sum()
    else:
        trace_low = lam * cov_factor.square().sum()
        maha = lam * torch.dot(mean, mean)
        log_lam = dim * math.log(lam)
    eye = torch.eye(rank, dtype=mean.dtype, device=mean.device)
    chol = torch.linalg.cholesky(eye + alpha * gram)
    logdet_gram = 2.0 * torch.log(torch.diagonal(chol)).sum()
    return 0.5 * (trace_diag + alpha * trace_low + maha - dim - log_lam - logdet_diag - logdet_gram)


@dataclass(frozen=True)
class _Terms:
    var: Tensor | None  # (D,)  learned sigma^2, or None for the constant diagonal
    var_parts: list[Tensor] | None
    kl: Tensor | None


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
            and on the options ``gmfvi`` refuses.
    """

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
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            start = sum(self.param_sizes[: layer.weight_param])
            self.layer_offsets.append(start)
            weight = means[layer.weight_param]
            scale = 0.5 * float(weight.std(correction=0)) / math.sqrt(K)
            shape = (K, layer.out_features, layer.in_features)
            tensors[f"v_weight{layer.index}"] = scale * standard_normal(shape, g, self.mean)
            if layer.bias_param is not None:
                shape_b = (K, layer.out_features)
                tensors[f"v_bias{layer.index}"] = _BIAS_FACTOR_SCALE * standard_normal(shape_b, g, self.mean)
        if self.learn_diag:
            tensors["rho"] = softplus_inverse(torch.full_like(self.mean, self.init_std))
        # one number per layer when the prior precision is constant on it (the usual case): cheaper KL
        self.layer_prior = []
        for layer, start in zip(self.layers, self.layer_offsets):
            lam = self.prior_precision.narrow(0, start, layer.n_params)
            self.layer_prior.append(float(lam[0]) if bool((lam == lam[0]).all()) else lam)
        for t in tensors.values():
            t.requires_grad_(True)
        return tensors

    def _factor(self, layer: LinearLayer) -> tuple[Tensor, Tensor | None]:
        return self.variational[f"v_weight{layer.index}"], self.variational.get(f"v_bias{layer.index}")

    def layer_cov_factor(self, layer: LinearLayer) -> Tensor:
        """:math:`V_l^\\top = [v_1 \\dots v_K]^\\top` in the layer's flat order (weight, then bias): ``(K, D_l)``."""
        v_weight, v_bias = self._factor(layer)
        parts = [v_weight.flatten(1)] + ([] if v_bias is None else [v_bias])
        return torch.cat(parts, dim=1)

    def layer_cov_diag(self, layer: LinearLayer, var: Tensor | None = None) -> Tensor | float:
        """The diagonal variances of layer ``layer``: ``(D_l,)`` when learned, else one number."""
        if not self.learn_diag:
            return self.init_std**2
        var = var if var is not None else F.softplus(self.variational["rho"]).square()
        return var.narrow(0, self.layer_offsets[layer.index - 1], layer.n_params)

    def _step_terms(self, with_kl: bool) -> _Terms:
        var = F.softplus(self.variational["rho"]).square() if self.learn_diag else None
        kl = None
        if with_kl:
            terms = []
            for layer, start, lam in zip(self.layers, self.layer_offsets, self.layer_prior):
                terms.append(
                    elrg_kl(
                        self.mean.narrow(0, start, layer.n_params),
                        self.layer_cov_factor(layer),
                        self.layer_cov_diag(layer, var),
                        lam,
                        self.alpha,
                    )
                )
            kl = torch.stack(terms).sum()
        return _Terms(var=var, var_parts=None if var is None else self.split_params(var), kl=kl)

    def _local_preactivation(
        self, terms: _Terms, layer: LinearLayer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        g, K, out = self.problem.generator, self.rank, layer.out_features
        v_weight, v_bias = self._factor(layer)
        mean = F.linear(a, weight_mean, bias_mean)  # F_mu(x)
        low = F.linear(a, v_weight.view(K * out, -1), None if v_bias is None else v_bias.view(K * out))
        low = low.unflatten(-1, (K, out))  # (..., K, out): F_{v_k}(x)
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
            w_size = layer.n_weights
            parts[layer.weight_param] = low[:, :w_size]
            if layer.bias_param is not None:
                parts[layer.bias_param] = low[:, w_size:]
        low_all = torch.cat(parts, dim=1)
        eps = standard_normal((n_samples, self.mean.numel()), g, self.mean)
        diag_std = sqrt_or_tiny(terms.var) if terms.var is not None else self.init_std
        return self.mean + low_all + diag_std * eps

    def _snr_grads(self, layer: LinearLayer) -> list[Tensor]:
        v_weight = self.variational[f"v_weight{layer.index}"]
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

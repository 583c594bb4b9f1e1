r"""The k-tied Normal: mean-field Gaussian VI whose weight standard deviations are a rank-k product.

Swiatkowski et al. (2020), Eq. 8: for a layer with weight matrix :math:`W \in \mathbb R^{m \times n}`
(m inputs, n outputs; PyTorch stores :math:`W^\top`, ``(out, in)``)

.. math::

    q(W) = \mathcal N\bigl(\mu, \operatorname{diag}(\operatorname{vec}((U V^\top)^2))\bigr),
    \qquad U \in \mathbb R_+^{m \times k},\; V \in \mathbb R_+^{n \times k},

i.e. :math:`\sigma_{ij} = \sum_r u_{ir} v_{jr}`, with :math:`U = \operatorname{softplus}(\tilde U)`,
:math:`V = \operatorname{softplus}(\tilde V)` kept positive. Biases keep one softplus standard deviation
each (as in the paper, which ties only the kernels). Variational parameters per layer: :math:`mn + k(m + n)`
for the weights (Table 1) plus :math:`2n` for the bias; :func:`ktied_param_count`. A layer's rank is
:math:`k_l = \min(k, m, n)`: a product of rank above :math:`\min(m, n)` is no longer a restriction, so the
regression head of a UCI network (n = 1) uses rank 1 whatever ``k`` is.

Training (``bdl_bench.methods._layerwise_vi``) uses the local reparameterisation trick. Because
:math:`\sigma^2_{ij} = \sum_{r,s} (u_{ir} u_{is})(v_{jr} v_{js})` has rank at most :math:`k^2`, the variance
of the pre-activations needs no layer-sized product (a Khatri–Rao factorisation):

.. math::

    a^2 (\sigma^2)^\top = \bigl(a^2 P_U\bigr) P_V^\top, \qquad (P_U)_{i,(r,s)} = u_{ir}u_{is},\;
    (P_V)_{j,(r,s)} = v_{jr}v_{js},

:math:`O(Nk^2(m + n))` instead of :math:`O(Nmn)`, so a k-tied step costs one layer-sized product forward
(as SGD) where mean-field GMFVI needs two. The KL is the closed form of the mean-field Gaussian with
:math:`\sigma = UV^\top` materialised (:math:`O(kmn)`, Table 4's remark). The gradient SNR tracked with
``snr_window`` is that of :math:`\tilde U` and :math:`\tilde V` (the paper's u and v "in their log forms";
softplus behaves as exp for the small values used here).

Initialisation (Sec. 3.1: "the σ_ij have the same mean values as in the standard GMFVI"): entries
:math:`u_{ir}, v_{jr} \propto e^{0.1\,\epsilon}` with :math:`\epsilon \sim \mathcal N(0, 1)` from the problem's
generator, scaled by one common factor so that the mean of :math:`UV^\top` is exactly :math:`\sigma_0` =
``init_std`` (the entries scatter by some ten per cent around it). The small jitter breaks the symmetry between the k
columns, which would otherwise receive identical gradients and stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.methods._layerwise_vi import LayerwiseVI, LinearLayer, check_positive_int, sqrt_or_tiny
from bdl_bench.methods.base import register_method
from bdl_bench.methods.bbb import softplus_inverse, standard_normal
from bdl_bench.methods.gmfvi import diag_kl

_INIT_JITTER = 0.1  # log-scale jitter of the initial factors (symmetry breaking)


def ktied_param_count(m: int, n: int, k: int) -> int:
    """Variational parameters of an ``m × n`` weight matrix under the k-tied Normal: ``mn + k(m + n)``
    (Swiatkowski et al. 2020, Table 1; mean-field has ``2mn``)."""
    return m * n + k * (m + n)


def khatri_rao_square(factor: Tensor) -> Tensor:
    """Column-wise outer products ``P_{(r,s),i} = f_{ri} f_{si}`` of ``factor (k, cols)``: ``(k², cols)``."""
    return (factor.unsqueeze(1) * factor.unsqueeze(0)).flatten(0, 1)


def ktied_variance(a: Tensor, in_factor: Tensor, out_factor: Tensor) -> Tensor:
    r""":math:`a^2 (\sigma^2)^\top` for :math:`\sigma = V U^\top` (``(out, in)``) without forming :math:`\sigma`.

    Args:
        a: layer inputs ``(..., in)``.
        in_factor: :math:`U^\top \geq 0`, ``(k, in)``.
        out_factor: :math:`V^\top \geq 0`, ``(k, out)``.

    Returns:
        ``(..., out)``, equal to ``F.linear(a**2, (out_factor.T @ in_factor)**2)``.
    """
    return (a * a) @ khatri_rao_square(in_factor).T @ khatri_rao_square(out_factor)


@dataclass(frozen=True)
class _Terms:
    in_factors: list[Tensor]  # per layer U^T (k_l, in)
    out_factors: list[Tensor]  # per layer V^T (k_l, out)
    bias_std: list[Tensor | None]  # per layer (out,)
    kl: Tensor | None


@register_method("ktied")
class KTiedNormalVI(LayerwiseVI):
    """GMFVI with k-tied weight standard deviations (see the module docstring).

    Args:
        k: the rank of the tying (``k_l = min(k, in, out)`` per layer).
        lr: Adam learning rate.
        n_train_mc_samples: MC samples S per training step.
        init_std: the initial :math:`\\sigma` of every parameter, as in GMFVI.
        kl_annealing_steps: steps of linear KL annealing (0: none).
        snr_window: steps per gradient-SNR window of :math:`\\tilde U, \\tilde V` (0: off).

    Raises:
        ValueError: if ``k`` is not an integer >= 1 (at construction) or exceeds ``min(in, out)`` of
            every linear layer of the model (at ``setup``), and on the options ``gmfvi`` refuses.
    """

    def __init__(
        self,
        *,
        k: int,
        lr: float,
        n_train_mc_samples: int,
        init_std: float,
        kl_annealing_steps: int,
        snr_window: int,
    ) -> None:
        self.k = check_positive_int("ktied", "k", k)
        super().__init__(
            lr=lr,
            n_train_mc_samples=n_train_mc_samples,
            init_std=init_std,
            kl_annealing_steps=kl_annealing_steps,
            snr_window=snr_window,
        )

    def layer_rank(self, layer: LinearLayer) -> int:
        return min(self.k, layer.in_features, layer.out_features)

    def _init_variational(self) -> dict[str, Tensor]:
        largest = max(min(layer.in_features, layer.out_features) for layer in self.layers)
        if self.k > largest:
            shapes = ", ".join(f"{layer.in_features}→{layer.out_features}" for layer in self.layers)
            raise ValueError(
                f"ktied: k={self.k} exceeds the largest possible rank of a weight matrix of this model"
                f" ({largest}; layers {shapes}); choose 1 <= k <= {largest}"
            )
        g = self.problem.generator
        lam_parts = self.split_params(self.prior_precision)
        self.prior_parts = lam_parts
        self.log_prior_parts = [float(torch.log(p).sum()) for p in lam_parts]
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            rank = self.layer_rank(layer)
            # stored transposed, (k, in) and (k, out): the products below then run in the fast layouts
            u = torch.exp(_INIT_JITTER * standard_normal((rank, layer.in_features), g, self.mean))
            v = torch.exp(_INIT_JITTER * standard_normal((rank, layer.out_features), g, self.mean))
            scale = math.sqrt(self.init_std / float((v.T @ u).mean()))  # mean of V U^T = init_std exactly
            tensors[f"u{layer.index}"] = softplus_inverse(scale * u)
            tensors[f"v{layer.index}"] = softplus_inverse(scale * v)
            if layer.bias_param is not None:
                init = torch.full((layer.out_features,), self.init_std, dtype=self.mean.dtype, device=self.mean.device)
                tensors[f"bias_rho{layer.index}"] = softplus_inverse(init)
        for t in tensors.values():
            t.requires_grad_(True)
        return tensors

    def _step_terms(self, with_kl: bool) -> _Terms:
        ins, outs, bias_std = [], [], []
        for layer in self.layers:
            ins.append(F.softplus(self.variational[f"u{layer.index}"]))
            outs.append(F.softplus(self.variational[f"v{layer.index}"]))
            rho = self.variational.get(f"bias_rho{layer.index}")
            bias_std.append(None if rho is None else F.softplus(rho))
        kl = None
        if with_kl:
            means = self.split_params(self.mean)
            terms = []
            for layer, u, v, b_std in zip(self.layers, ins, outs, bias_std):
                w = layer.weight_param
                terms.append(diag_kl(means[w], v.T @ u, self.prior_parts[w], self.log_prior_parts[w]))
                if b_std is not None:
                    b = layer.bias_param
                    terms.append(diag_kl(means[b], b_std, self.prior_parts[b], self.log_prior_parts[b]))
            kl = torch.stack(terms).sum()
        return _Terms(
            in_factors=ins,
            out_factors=outs,
            bias_std=bias_std,
            kl=kl,
        )

    def _local_preactivation(
        self, terms: _Terms, layer: LinearLayer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        i = layer.index - 1
        mean = F.linear(a, weight_mean, bias_mean)
        var = ktied_variance(a, terms.in_factors[i], terms.out_factors[i])
        if terms.bias_std[i] is not None:
            var = var + terms.bias_std[i] ** 2
        eps = standard_normal(tuple(mean.shape), self.problem.generator, mean)
        return mean + sqrt_or_tiny(var) * eps

    def flat_std(self, terms: _Terms | None = None) -> Tensor:
        """Every parameter's standard deviation in flat order, ``(D,)``."""
        terms = terms if terms is not None else self._step_terms(with_kl=False)
        parts: list[Tensor] = [torch.empty(0)] * len(self.param_sizes)
        for layer, u, v, b_std in zip(self.layers, terms.in_factors, terms.out_factors, terms.bias_std):
            parts[layer.weight_param] = (v.T @ u).flatten()
            if b_std is not None:
                parts[layer.bias_param] = b_std
        return torch.cat(parts)

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        eps = standard_normal((n_samples, self.mean.numel()), self.problem.generator, self.mean)
        return self.mean + self.flat_std(terms) * eps

    def _snr_grads(self, layer: LinearLayer) -> list[Tensor]:
        tensors = [self.variational[f"u{layer.index}"], self.variational[f"v{layer.index}"]]
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]

    @torch.no_grad()
    def weight_stds(self) -> list[Tensor]:
        """Each linear layer's matrix of weight standard deviations :math:`VU^\\top`, ``(out, in)``."""
        terms = self._step_terms(with_kl=False)
        return [v.T @ u for u, v in zip(terms.in_factors, terms.out_factors)]

    @torch.no_grad()
    def posterior(self) -> DiagGaussian:
        """The k-tied Normal as a diagonal Gaussian over the flat parameters (precision :math:`1/\\sigma^2`)."""
        return DiagGaussian(mean=self.mean.detach().clone(), prec_diag=self.flat_std().pow(-2))

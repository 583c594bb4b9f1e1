r"""The k-tied Normal: mean-field Gaussian VI whose weight standard deviations are a rank-k product.

Swiatkowski et al. (2020), Eq. 8: for a layer with weight matrix :math:`W \in \mathbb R^{m \times n}`
(m inputs, n outputs; PyTorch stores :math:`W^\top`, ``(out, in)``)

.. math::

    q(W) = \mathcal N\bigl(\mu, \operatorname{diag}(\operatorname{vec}((U V^\top)^2))\bigr),
    \qquad U \in \mathbb R_+^{m \times k},\; V \in \mathbb R_+^{n \times k},

i.e. :math:`\sigma_{ij} = \sum_r u_{ir} v_{jr}`, with :math:`U = \operatorname{softplus}(\tilde U)`,
:math:`V = \operatorname{softplus}(\tilde V)`. Biases keep one softplus standard deviation each (the paper
ties only the kernels). Variational parameters per weight: :math:`mn + k(m + n)` (Table 1;
:func:`ktied_param_count`). A layer's rank is :math:`k_l = \min(k, m, n)` (a higher rank restricts nothing).

Which weights are tied (Sec. 3.1: "all the three layers of the MLP model, the two dense layers of the CNN
model and the LSTM cell's kernel and recurrent kernel"):

- ``nn.Linear``: the weight.
- ``nn.LSTM``: ``weight_ih`` (:math:`4H \times m`) and ``weight_hh`` (:math:`4H \times H`) of each layer
  separately, outputs × inputs as the paper's Keras kernels transposed.
- ``nn.Conv2d``: mean-field by default, as the paper's CNN (this reproduces its Table 3 parameter counts).
  With ``tie_conv: true`` a kernel is tied as PyTorch's ``(C_out, C_in/groups·kh·kw)`` matrix
  :math:`VU^\top`, the reshaping under which the paper finds low-rank convolutional standard deviations (Fig. 5).
- ``nn.Embedding``: mean-field (the paper ties no embedding).

Training (``bdl_bench.methods._layerwise_vi``) uses the local reparameterisation trick. Because
:math:`\sigma^2_{ij} = \sum_{r,s} (u_{ir} u_{is})(v_{jr} v_{js})` has rank at most :math:`k^2`, the variance
of the pre-activations needs no layer-sized product (a Khatri–Rao factorisation):

.. math::

    a^2 (\sigma^2)^\top = \bigl(a^2 P_U\bigr) P_V^\top, \qquad (P_U)_{i,(r,s)} = u_{ir}u_{is},\;
    (P_V)_{j,(r,s)} = v_{jr}v_{js},

:math:`O(Nk^2(m + n))` instead of :math:`O(Nmn)`. A convolution's variance is one more convolution with the
materialised :math:`\sigma^2`, as in GMFVI. The KL is the mean-field closed form with :math:`\sigma = UV^\top`
materialised (:math:`O(kmn)`, Table 4's remark). The gradient SNR tracked is that of :math:`\tilde U` and
:math:`\tilde V` (the paper's u and v "in their log forms").

Initialisation (Sec. 3.1: "the σ_ij have the same mean values as in the standard GMFVI"): entries
:math:`u_{ir}, v_{jr} \propto e^{0.1\,\epsilon}`, :math:`\epsilon \sim \mathcal N(0, 1)`, scaled so that the mean of
:math:`UV^\top` is exactly ``init_std``; the jitter breaks the symmetry between the k columns, which would
otherwise receive identical gradients and stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.kernels.diag_vi import diag_kl, prior_quadratic
from bdl_bench.methods._diag_vi import (
    local_reparam_linear,
    softplus_inverse,
    sqrt_or_tiny,
    standard_normal,
    uniform_value,
)
from bdl_bench.methods._layerwise_vi import Layer, LayerwiseVI, base_options, conv2d
from bdl_bench.methods.base import register_method
from bdl_bench.ranges import COUNT

_INIT_JITTER = 0.1  # log-scale jitter of the initial factors (symmetry breaking)


def ktied_param_count(m: int, n: int, k: int) -> int:
    """Variational parameters of an ``m × n`` weight matrix under the k-tied Normal: ``mn + k(m + n)``
    (Swiatkowski et al. 2020, Table 1; mean-field has ``2mn``)."""
    return m * n + k * (m + n)


def khatri_rao_square(factor: Tensor) -> Tensor:
    """Column-wise outer products ``P_{(r,s),i} = f_{ri} f_{si}`` of ``factor (k, cols)``: ``(k², cols)``."""
    return (factor.unsqueeze(1) * factor.unsqueeze(0)).flatten(0, 1)


def ktied_variance(a: Tensor, in_factor: Tensor, out_factor: Tensor, bias_var: Tensor | None = None) -> Tensor:
    r""":math:`a^2 (\sigma^2)^\top` (plus ``bias_var``) for :math:`\sigma = V U^\top` without forming :math:`\sigma`:
    ``F.linear(a**2, (out_factor.T @ in_factor)**2, bias_var)`` for ``a`` ``(..., in)``, ``in_factor``
    :math:`U^\top` ``(k, in)`` and ``out_factor`` :math:`V^\top` ``(k, out)``."""
    low = (a * a) @ khatri_rao_square(in_factor).T
    if bias_var is None:
        return low @ khatri_rao_square(out_factor)
    if a.dim() == 2:
        return torch.addmm(bias_var, low, khatri_rao_square(out_factor))
    return low @ khatri_rao_square(out_factor) + bias_var


@dataclass(frozen=True)
class _Terms:
    factors: dict[int, tuple[Tensor, Tensor]]  # tied weight (its position) -> (U^T (k_l, cols), V^T (k_l, rows)) > 0
    stds: dict[int, Tensor]  # every other parameter (its position) -> its standard deviations, parameter-shaped
    kl: Tensor | None
    mean_parts: list[Tensor] | None = None  # the mean's parts to run the network on (one split per step)


@register_method("ktied")
class KTiedNormalVI(LayerwiseVI):
    """GMFVI with k-tied weight standard deviations (see the module docstring)."""

    option_ranges = MappingProxyType({**LayerwiseVI.option_ranges, "k": COUNT})

    def __init__(
        self,
        *,
        k: int,
        tie_conv: bool,
        lr: float,
        n_train_mc_samples: int,
        init_std: float,
        kl_annealing_steps: int,
        snr_window: int,
        conv_estimator: str,
        record_every: int = 0,
    ) -> None:
        self.keep_options(locals())
        if not isinstance(tie_conv, bool):
            raise ConfigError(f"ktied: tie_conv must be true or false, got {tie_conv!r}")
        self.tie_conv = tie_conv
        super().__init__(**base_options(locals()))

    def is_tied(self, layer: Layer) -> bool:
        """Whether ``layer``'s weight matrices are k-tied (module docstring)."""
        return isinstance(layer.module, (nn.Linear, nn.LSTM)) or (self.tie_conv and isinstance(layer.module, nn.Conv2d))

    def matrix_shape(self, position: int) -> tuple[int, int]:
        """``(rows, columns)`` of the parameter at ``position`` as a matrix (outputs × inputs)."""
        shape = self.param_shapes[position]
        return shape[0], math.prod(shape[1:])

    def matrix_rank(self, position: int) -> int:
        """:math:`k_l = \\min(k, \\text{rows}, \\text{columns})` of a tied weight matrix."""
        return min(self.k, *self.matrix_shape(position))

    def _check_k(self) -> None:
        tied = [
            (f"{layer.name}.{name}", pos)
            for layer in self.layers
            if self.is_tied(layer)
            for name, pos in layer.weight_matrices
        ]
        if not tied:
            return
        largest = max(min(self.matrix_shape(pos)) for _, pos in tied)
        if self.k > largest:
            shapes = ", ".join(
                f"{label} {self.matrix_shape(pos)[1]}→{self.matrix_shape(pos)[0]}" for label, pos in tied
            )
            raise ConfigError(
                f"ktied: k={self.k} exceeds the largest possible rank of a tied weight matrix of this model"
                f" ({largest}; {shapes}); choose 1 <= k <= {largest}"
            )

    def _init_variational(self) -> dict[str, Tensor]:
        self._check_k()
        g = self.problem.generator
        lam_parts = self.split_params(self.prior_precision)
        self.log_prior_parts = [float(torch.log(p).sum()) for p in lam_parts]
        self.prior_parts = [uniform_value(p) for p in lam_parts]  # one number where shared (the usual case)
        self._prior = uniform_value(self.prior_precision)
        self._kl_scratch = self.mean.new_empty(max(self.param_sizes) // 2 + 1)  # sum_log's, from step to step
        self.factor_keys: dict[int, tuple[str, str]] = {}  # tied weight position -> (U key, V key)
        self.rho_keys: dict[int, str] = {}  # every other parameter's position -> its rho key
        tensors: dict[str, Tensor] = {}
        for layer in self.layers:
            tied = dict(layer.weight_matrices) if self.is_tied(layer) else {}
            for name, pos in layer.params.items():
                # dense layers keep the names u<i>, v<i>, bias_rho<i>; others add the parameter's name
                # (u2_weight_ih_l0, rho1_weight for an untied convolution or embedding)
                if name in tied:
                    suffix = "" if name == "weight" else f"_{name}"
                    rank, (rows, cols) = self.matrix_rank(pos), self.matrix_shape(pos)
                    # stored transposed, (k, cols) and (k, rows): the products below then run in the fast layouts
                    u = torch.exp(_INIT_JITTER * standard_normal((rank, cols), g, self.mean))
                    v = torch.exp(_INIT_JITTER * standard_normal((rank, rows), g, self.mean))
                    scale = math.sqrt(self.init_std / float((v.T @ u).mean()))  # mean of V U^T = init_std exactly
                    keys = (f"u{layer.index}{suffix}", f"v{layer.index}{suffix}")
                    tensors[keys[0]], tensors[keys[1]] = softplus_inverse(scale * u), softplus_inverse(scale * v)
                    self.factor_keys[pos] = keys
                else:
                    key = f"bias_rho{layer.index}" if name == "bias" else f"rho{layer.index}_{name}"
                    tensors[key] = softplus_inverse(self.mean.new_full(self.param_shapes[pos], self.init_std))
                    self.rho_keys[pos] = key
        for t in tensors.values():
            t.requires_grad_(True)
        return tensors

    def _step_terms(self, with_kl: bool) -> _Terms:
        var = self.variational
        factors = {pos: (F.softplus(var[u]), F.softplus(var[v])) for pos, (u, v) in self.factor_keys.items()}
        stds = {pos: F.softplus(var[key]) for pos, key in self.rho_keys.items()}
        terms = _Terms(factors=factors, stds=stds, kl=None)
        if not with_kl:
            return terms
        # the KL's term in the mean on the flat mean (its gradient added to .grad in place), the rest per part
        parts = range(len(self.param_sizes))
        scratch, priors, log_priors = self._kl_scratch, self.prior_parts, self.log_prior_parts
        kl = torch.stack([diag_kl(self._param_std(terms, p), priors[p], log_priors[p], scratch) for p in parts])
        kl = kl.sum() + prior_quadratic(self.mean, self._prior)
        return _Terms(factors=factors, stds=stds, kl=kl, mean_parts=self.mean_parts())

    def _param_std(self, terms: _Terms, position: int) -> Tensor:
        """The standard deviations of the parameter at ``position``, in its shape (:math:`VU^\\top` if tied)."""
        if position in terms.factors:
            u, v = terms.factors[position]
            return (v.T @ u).view(self.param_shapes[position])
        return terms.stds[position]

    def _local_preactivation(
        self, terms: _Terms, layer: Layer, a: Tensor, weight_mean: Tensor, bias_mean: Tensor | None
    ) -> Tensor:
        g, pos = self.problem.generator, layer.weight_param
        bias_var = None if layer.bias_param is None else terms.stds[layer.bias_param] ** 2
        if isinstance(layer.module, nn.Linear):
            mean = F.linear(a, weight_mean, bias_mean)
            var = ktied_variance(a, *terms.factors[pos], bias_var)
            eps = standard_normal(tuple(mean.shape), g, mean)
            return torch.addcmul(mean, sqrt_or_tiny(var), eps)
        # nn.Conv2d: one more convolution, with the materialised variances (tied or not)
        weight_var = self._param_std(terms, pos).square()
        return local_reparam_linear(a, weight_mean, weight_var, bias_mean, bias_var, g, partial(conv2d, layer))

    def flat_std(self, terms: _Terms | None = None) -> Tensor:
        """Every parameter's standard deviation in flat order, ``(D,)``."""
        terms = terms if terms is not None else self._step_terms(with_kl=False)
        return torch.cat([self._param_std(terms, pos).flatten() for pos in range(len(self.param_sizes))])

    def _sample_params(self, terms: _Terms, n_samples: int) -> Tensor:
        eps = standard_normal((n_samples, self.mean.numel()), self.problem.generator, self.mean)
        return self.mean + self.flat_std(terms) * eps

    def _snr_grads(self, layer: Layer) -> list[Tensor]:
        keys = []
        for _, pos in layer.weight_matrices:
            keys += self.factor_keys[pos] if pos in self.factor_keys else [self.rho_keys[pos]]
        tensors = [self.variational[key] for key in keys]
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]

    @torch.no_grad()
    def posterior(self) -> DiagGaussian:
        """The k-tied Normal as a diagonal Gaussian over the flat parameters (precision :math:`1/\\sigma^2`)."""
        return DiagGaussian(mean=self.mean.detach().clone(), prec_diag=self.flat_std().pow(-2))

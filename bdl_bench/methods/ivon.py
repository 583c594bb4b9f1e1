r"""IVON, the Improved Variational Online Newton (Shen et al., "Variational Learning is Effective for Large Deep
Networks", ICML 2024, Algorithm 1): mean-field Gaussian VI with an Adam-like natural-gradient update.

The posterior over the flat parameters :math:`\theta \in \mathbb R^D` (the order of ``bdl_bench.models.params``) is
:math:`q(\theta) = \mathcal N(m, \operatorname{diag}(\sigma^2))` with :math:`\sigma = 1/\sqrt{\lambda (h + \delta)}`:
:math:`h` is a running estimate of the expected Hessian of the per-example loss :math:`\bar\ell`, :math:`\lambda`
the effective sample size and :math:`\delta` the weight decay. Here :math:`\lambda = N` (``problem.n_data``) and
:math:`\delta = \lambda_0 / N` per parameter, with :math:`\lambda_0` the prior precision
(``problem.prior_precision``), so the posterior precision is :math:`N h + \lambda_0` and the paper's prior
:math:`\mathcal N(0, (\lambda\delta)^{-1} I)` is the project's :math:`\mathcal N(0, \operatorname{diag}(\lambda_0)^{-1})`.

Algorithm 1, per step t = 1, 2, ... on a minibatch (:math:`\bar\ell` its mean negative log-likelihood):

.. math::

    \theta_s &= m + \sigma \odot \epsilon_s, \quad \epsilon_s \sim \mathcal N(0, I), \; s = 1..S \\
    \hat g &= \tfrac1S \textstyle\sum_s \nabla\bar\ell(\theta_s), \qquad
    \hat h = \tfrac1S \textstyle\sum_s \nabla\bar\ell(\theta_s) \odot (\theta_s - m) / \sigma^2 \\
    g &\leftarrow \beta_1 g + (1 - \beta_1) \hat g \\
    h &\leftarrow \beta_2 h + (1 - \beta_2) \hat h + \tfrac12 (1 - \beta_2)^2 (h - \hat h)^2 / (h + \delta) \\
    \bar g &= g / (1 - \beta_1^t) \\
    m &\leftarrow m - \alpha_t \operatorname{clip}\bigl((\bar g + \delta m) / (h + \delta), \xi\bigr) \\
    \sigma &= 1 / \sqrt{\lambda (h + \delta)}

(:math:`\beta_1, \beta_2` = ``beta1``, ``beta2``) starting from m = the network's weights, :math:`h = h_0`
(``hess_init``), g = 0. :math:`\hat h` is the reparameterisation-trick estimate of the expected Hessian's
diagonal (Stein's lemma: :math:`\mathbb E_q[\nabla^2\bar\ell] = \mathbb E_q[\nabla\bar\ell \, (\theta - m)^\top]
\Sigma^{-1}`); since
:math:`(\theta_s - m)/\sigma^2 = \epsilon_s / \sigma`, it costs one product with the gradients and needs no
per-example gradient. The third term of the h update keeps :math:`h + \delta` positive whatever :math:`\hat h`'s
sign: with :math:`a = h + \delta`, :math:`u = (h - \hat h)/a` and :math:`c = 1 - \beta_2` the new
:math:`h + \delta` is :math:`a(1 - cu + \tfrac12 c^2u^2) = a\bigl(\tfrac12(1 - cu)^2 + \tfrac12\bigr) > 0`
(the Riemannian-gradient correction of Lin, Schmidt & Khan 2020). :math:`\operatorname{clip}(\cdot, \xi)` clamps
each coordinate to :math:`[-\xi, \xi]` (``clip_radius``; ``null`` = no clipping), and
:math:`\alpha_t = ` ``lr`` :math:`/(1 + t^{\gamma})` (``decay`` :math:`\gamma`; 0 = constant).

The step reports ``loss`` = ``nll`` + ``kl``, the minibatch estimate of the negative ELBO per example under
the q that drew the samples: ``nll`` the S-sample mean of :math:`\bar\ell`, ``kl`` =
:math:`\mathrm{KL}(q \,\|\, p) / N` in closed form (:func:`_kl_from_precision`).

**Stacked copies.** m, h, g and the prior precisions carry a leading copy dimension R; each step draws one
``(S, D)`` block of standard normals and shares it between the copies, so copy r draws exactly what a single
run of the same seed draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bdl_bench.curvature.gram import workspace_buffer
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.likelihoods import stacked_nll
from bdl_bench.methods._diag_vi import standard_normal
from bdl_bench.methods._shared import decayed_rate, in_chunks
from bdl_bench.methods.base import Problem, StackedMethod, register_method
from bdl_bench.models.params import forward_with
from bdl_bench.ranges import COUNT, POSITIVE, Range

_STATE = ("mean", "hess", "momentum")  # the (R, D) tensors a checkpoint holds, with the step t


def _kl_from_precision(
    mean: Tensor, precision: Tensor, prior_precision: Tensor, workspace: dict[str, Tensor] | None = None
) -> Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(m, \operatorname{diag}(P)^{-1}) \,\|\, \mathcal N(0,
    \operatorname{diag}(\lambda_0)^{-1}))` of each row of ``(R, D)`` inputs, ``(R,)``:
    :math:`\tfrac12 \sum_d (r_d + \lambda_{0d} m_d^2 - 1 - \log r_d)`, :math:`r = \lambda_0 / P`; its
    temporaries in ``workspace``'s buffers where given."""
    ratio = torch.div(prior_precision, precision, out=workspace_buffer(workspace, "ratio", mean.shape, mean))
    scaled = torch.mul(prior_precision, mean, out=workspace_buffer(workspace, "scaled", mean.shape, mean))
    quadratic = torch.linalg.vecdot(scaled, mean)
    return 0.5 * (ratio.sum(-1) + quadratic - mean.shape[-1] - ratio.log_().sum(-1))


@register_method("ivon")
class IVON(StackedMethod):
    """IVON (Shen et al. 2024, Algorithm 1; the module docstring names the options), ``n_train_mc_samples`` S."""

    option_ranges = MappingProxyType(
        {
            "lr": POSITIVE,
            "beta1": Range(0, 1, high_open=True),
            "beta2": Range(0, 1, high_open=True),
            "hess_init": POSITIVE,
            "n_train_mc_samples": COUNT,
            "clip_radius": Range(0, low_open=True, nullable=True),
            "decay": Range(0),
        }
    )
    copy_state: ClassVar[tuple[str, ...]] = ("mean", "hess", "momentum", "prior")

    def __init__(
        self,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        hess_init: float,
        n_train_mc_samples: int,
        clip_radius: float | None = None,
        decay: float = 0.0,
    ) -> None:
        self.keep_options(locals())

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """R copies starting from the model's weights: m ``(R, D)``, h = ``hess_init``, g = 0, and each copy's
        prior precision ``(R, D)``; a model with dropout is refused (its noise would not come from the generator)."""
        super().setup_stack(problems)
        model = self.problem.model
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
            raise ConfigError("ivon: the model contains dropout layers; build it with dropout=0")
        self.mean, self.prior = self.stacked_start()  # (R, D)  m, lambda_0
        self.hess = torch.full_like(self.mean, self.hess_init)  # (R, D)  h
        self.momentum = torch.zeros_like(self.mean)  # (R, D)  g
        self.step = 0  # t of the last update
        self._workspace: dict[str, Tensor] = {}  # the step's (R, D) scratch buffers, reused from step to step

    def _precision(self, workspace: dict[str, Tensor] | None = None) -> Tensor:
        """The posterior precision :math:`N h + \\lambda_0 = \\lambda (h + \\delta)` (:math:`= 1/\\sigma^2`), ``(R, D)``
        (in ``workspace``'s buffer where given)."""
        out = workspace_buffer(workspace, "precision", self.hess.shape, self.hess)
        return torch.add(self.prior, self.hess, alpha=self.problem.n_data, out=out)

    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One step of Algorithm 1 for every copy on its minibatch ``x`` ``(R, M, ...)``, ``y`` ``(R, M)``; its
        ``(R, D)`` temporaries live in reused buffers (a fresh large tensor costs page faults at first touch)."""
        likelihoods = [p.likelihood for p in self._copy_problems]
        model = self.problem.model
        ws = self._workspace
        n_copies, dim = self.mean.shape
        precision = self._precision(ws)
        std = torch.rsqrt(precision, out=workspace_buffer(ws, "std", precision.shape, precision))  # (R, D)
        shape = (self.n_train_mc_samples, dim)
        eps = standard_normal(shape, self.problem.generator, self.mean, workspace_buffer(ws, "eps", shape, self.mean))
        thetas = workspace_buffer(ws, "thetas", (n_copies, *shape), self.mean)
        torch.addcmul(self.mean.unsqueeze(1), std.unsqueeze(1), eps, out=thetas).requires_grad_(True)  # (R, S, D)
        with torch.enable_grad():
            f = torch.func.vmap(lambda th, xr: torch.func.vmap(lambda t: forward_with(model, t, xr))(th))(
                thetas, x
            )  # (R, S, M, out)
            nll = stacked_nll(likelihoods, f, y).mean(-1)  # (R, S)
            (grads,) = torch.autograd.grad(nll.sum(), thetas)  # (R, S, D): grad of copy r's l-bar at theta_rs
        thetas.requires_grad_(False)
        with torch.no_grad():
            kl = _kl_from_precision(self.mean, precision, self.prior, ws) / self.problem.n_data
            self._update(grads, eps, std, precision)
            nll = nll.detach().mean(1)
        return {"loss": nll + kl, "nll": nll, "kl": kl}

    def _update(self, grads: Tensor, eps: Tensor, std: Tensor, precision: Tensor) -> None:
        """Algorithm 1's updates of g, h and m from the samples' gradients ``(R, S, D)`` at
        :math:`\\theta_s = m + \\sigma \\odot \\epsilon_s` (``eps`` ``(S, D)``; ``std`` and ``precision`` the σ
        and :math:`N(h + \\delta)` that drew them; ``precision`` is overwritten).

        Written in a few in-place passes over the ``(R, D)`` state: with :math:`P = N(h + \\delta)`,
        :math:`h + \\delta = P/N`, and with :math:`b = 1 - \\beta_1^t` and :math:`u = g + b\\delta m`,
        :math:`(\\bar g + \\delta m)/(h + \\delta) = (N/b)\\,u/P'` (P' the updated precision), so the clip at ξ is
        one at :math:`\\xi b/N` of :math:`u/P'`.
        """
        self.step += 1
        ws = self._workspace
        n_data = self.problem.n_data
        h_hat = workspace_buffer(ws, "h_hat", self.mean.shape, self.mean)
        if grads.shape[1] == 1:  # one sample: no mean over samples to take
            g_hat = grads[:, 0]
            torch.mul(g_hat, eps[0], out=h_hat).div_(std)
        else:
            g_hat = grads.mean(1)
            torch.mean(grads.mul_(eps), 1, out=h_hat).div_(std)  # (grads no longer needed)
        # h-hat = mean_s g_s (theta_s - m) / sigma^2 = mean_s g_s eps_s / sigma
        self.momentum.lerp_(g_hat, 1 - self.beta1)
        c = 1 - self.beta2
        diff = h_hat.sub_(self.hess)  # h-hat - h
        self.hess.add_(diff, alpha=c)
        self.hess.addcdiv_(diff.square_(), precision, value=0.5 * c * c * n_data)  # (h - h-hat)^2 / (h + delta)
        bias = 1 - self.beta1**self.step
        u = torch.addcmul(self.momentum, self.prior, self.mean, value=bias / n_data, out=h_hat)  # g + b delta m
        new_precision = self._precision(ws)  # (overwrites precision: no longer needed)
        scale = decayed_rate(self.lr, self.decay, self.step) * n_data / bias
        if self.clip_radius is None:
            self.mean.addcdiv_(u, new_precision, value=-scale)
        else:
            radius = self.clip_radius * bias / n_data
            self.mean.add_(u.div_(new_precision).clamp_(-radius, radius), alpha=-scale)

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs of ``n_samples`` networks drawn from q (whole weight vectors): ``(S, N, out)``."""
        mean, std = self.only_copy(self.mean), self.only_copy(self._precision()).rsqrt()
        model = self.problem.model

        def draw(count: int) -> Tensor:
            thetas = torch.addcmul(mean, std, standard_normal((count, mean.numel()), self.problem.generator, mean))
            return torch.func.vmap(lambda theta: forward_with(model, theta, x))(thetas)

        return in_chunks(n_samples, draw)

    def posterior(self) -> DiagGaussian:
        """:math:`q = \\mathcal N(m, \\operatorname{diag}(N h + \\lambda_0)^{-1})`."""
        return DiagGaussian(mean=self.only_copy(self.mean).clone(), prec_diag=self.only_copy(self._precision()))

    @torch.no_grad()
    def kl_to_prior(self) -> Tensor:
        return self.only_copy(_kl_from_precision(self.mean, self._precision(), self.prior))

    def state_dict(self) -> dict[str, Any]:
        return {**{key: getattr(self, key).clone() for key in _STATE}, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in _STATE:
            getattr(self, key).copy_(state[key])
        self.step = int(state["step"])

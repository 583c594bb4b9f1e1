r"""SLANG: stochastic low-rank approximate natural-gradient VI (Mishkin et al., 2018).

The posterior over the flat parameter vector (order of ``bdl_bench.models.params``) is
:math:`q = \mathcal N(\mu, (UU^\top + \operatorname{diag}(d))^{-1})` with U of shape (D, L); the prior is
:math:`\mathcal N(0, \operatorname{diag}(\lambda)^{-1})` with :math:`\lambda` = ``problem.prior_precision``.
Step t = 1, 2, ... on a minibatch of M examples (Mishkin et al. 2018, Alg. 1 and eqs. 5-11, with the
options of the authors' code ``lib/optimizers/slang.py``):

1. Schedules (authors' ``decay_rates``): :math:`\alpha_t = \alpha / (1 + t^{\gamma})` and
   :math:`\beta_t = \beta / (1 + t^{\gamma_\beta})` for ``decay`` :math:`\gamma > 0` and ``beta_decay``
   :math:`\gamma_\beta` (``None``: :math:`\gamma`; their 1-D toy of App. F.1 decays the two at different
   rates); a zero exponent keeps its rate constant. (Paper's β; the authors' code passes :math:`1 - \beta` as
   Adam's second "beta" and decays :math:`\beta` itself.)
2. S = ``n_train_mc_samples`` draws :math:`\theta_s \sim q_t` (exact, O(D L) each:
   :func:`bdl_bench.curvature.low_rank.sample_noise`).
3. Per-example gradients :math:`g_{s,i} = \nabla_\theta[-\log p(y_i \mid x_i, \theta_s)]` as layer
   factors (:mod:`bdl_bench.curvature.per_example`), scaled as in the authors' code by
   :math:`c = N/(MS)`: :math:`\hat g = c\sum_{s,i} g_{s,i}`, :math:`\hat G = c\sum_{s,i} g_{s,i}g_{s,i}^\top`.
4. Low-rank step (eqs. 5-7), exact via the Gram trick (:func:`bdl_bench.curvature.low_rank_update`,
   instead of the paper's randomised eigensolver): :math:`U_{t+1} = Q_{1:L}\Lambda_{1:L}^{1/2}` from the
   top-L eigenpairs of :math:`(1-\beta_t)U_tU_t^\top + \beta_t\hat G`. For logistic regression (one
   linear layer, one output) the S·M gradients are first merged into M columns with the same
   :math:`\hat G` (:func:`bdl_bench.curvature.gram.merge_samples`): an example's S gradients are
   multiples of the same input.
5. Diagonal (eqs. 9-10): :math:`d_{t+1} = (1-\beta_t)d_t + \beta_t\lambda + \Delta_t` with
   :math:`\Delta_t = \operatorname{diag}[(1-\beta_t)U_tU_t^\top + \beta_t\hat G - U_{t+1}U_{t+1}^\top]`,
   clamped at 0 as in the authors' code (it is a diagonal of a PSD residual, so only rounding makes it
   negative).
6. Mean (eq. 11, Alg. 2 Woodbury solve) with the authors' momentum on the data gradient:
   :math:`m_t = \rho\,m_{t-1} + (1-\rho)\hat g`, :math:`\hat m_t = m_t / (1-\rho^t)` (bias correction,
   :math:`m_0 = 0`), :math:`\mu_{t+1} = \mu_t - \alpha_t (U_{t+1}U_{t+1}^\top + \operatorname{diag}
   d_{t+1})^{-1}(\hat m_t + \lambda\circ\mu_t)`. ``momentum`` :math:`\rho = 0` is the paper's eq. (11).

Initialisation (authors' code): :math:`\mu_0` = the model's parameters, :math:`U_0 = 0`,
:math:`d_0` = ``init_prec_diag`` (their ``s_init``) in every coordinate.

Implementation: the step is written once for R stacked copies (one per data split): the mean is ``(R, D)``,
U ``(R, D, L)`` stored column-major (each column contiguous, for :mod:`bdl_bench.curvature.gram`), and a single
run is the stack of one copy. The copies share one ``(S, D + L)`` draw of standard normals, so copy r draws
what a single run of its seed draws. The state's tensors are updated in place (``posterior()`` and
``state_dict()`` return copies); :math:`U^\top U`, :math:`\operatorname{diag}(UU^\top)` and the Cholesky
factor of :math:`I + U^\top D^{-1}U` are carried between steps (:class:`bdl_bench.curvature.low_rank.PrecisionCache`),
and D-sized temporaries live in a workspace kept between steps (:func:`bdl_bench.curvature.gram.workspace_buffer`).

``train_step`` reports ``nll`` (the minibatch mean of :math:`-\log p(y_i\mid\theta_s)`) and ``loss`` =
``nll`` + KL/N, the per-example negative ELBO estimate, where KL(:math:`q_t\,\|\,p`) is exact except
for its trace term :math:`\operatorname{tr}(\operatorname{diag}(\lambda)\Sigma_t)`, replaced by its
unbiased estimate :math:`\frac1S\sum_s(\theta_s-\mu_t)^\top\operatorname{diag}(\lambda)(\theta_s-\mu_t)`
from the training samples (the exact trace costs O(D L²); ``kl_to_prior`` is exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor

from bdl_bench.curvature.gram import low_rank_update, workspace_buffer
from bdl_bench.curvature.low_rank import PrecisionCache, build_cache, capacitance_cholesky, sample_noise, weighted_gram
from bdl_bench.curvature.per_example import LinearLayout, linear_layout
from bdl_bench.curvature.products import thin_matmul
from bdl_bench.curvature.stacked import StackedFactors, gradient_sum, stacked_factors
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, LowRankPlusDiagGaussian, kl
from bdl_bench.methods._diag_vi import sum_log, uniform_value
from bdl_bench.methods._shared import decayed_rate, in_chunks
from bdl_bench.methods.base import NonFiniteLossError, Problem, StackedMethod, register_method
from bdl_bench.models.params import forward_with
from bdl_bench.ranges import COUNT, POSITIVE, Range


class NonFiniteGradientError(NonFiniteLossError):
    """Raised when a SLANG step meets a NaN or infinite per-example gradient."""


@dataclass(frozen=True)
class SlangState:
    """What changes while SLANG fits (Alg. 1), for R stacked copies; overwritten by each ``train_step``."""

    mean: Tensor  # mu, (R, D)
    prec_factor: Tensor  # U, (R, D, L): precision U U^T + diag(d)
    prec_diag: Tensor  # d, (R, D)
    step: int  # t of the last update
    momentum: Tensor  # m, the EMA of the scaled data gradient before bias correction, (R, D)


def slang_update(
    state: SlangState,
    cache: PrecisionCache,
    factors: StackedFactors,
    layout: LinearLayout,
    *,
    n_data: int,
    prior_precision: Tensor,
    lr: float,
    beta: float,
    momentum: float,
    inplace: bool = False,
    workspace: dict[str, Tensor] | None = None,
) -> tuple[SlangState, PrecisionCache]:
    """One SLANG update of every copy (module docstring, items 3-6) from ``factors`` evaluated at S samples of
    :math:`q_t` on each copy's minibatch (:func:`bdl_bench.curvature.stacked.stacked_factors`); ``cache`` is the
    state's, ``prior_precision`` :math:`\\lambda` ``(R, D)``, ``lr`` and ``beta`` already scheduled. With
    ``inplace`` the tensors of ``state`` and the ``factor_sqnorms`` of ``cache`` are overwritten (no new D x L
    buffer); ``workspace`` holds scratch buffers kept between steps.

    Raises:
        NonFiniteGradientError: if a per-example gradient (or its Gram matrix) is not finite, naming the step
            (and the copy of a stack).
    """
    step = state.step + 1
    scale = n_data / factors.losses[0].numel()  # N / (M S)
    like = state.mean
    grad = gradient_sum(factors, layout, out=workspace_buffer(workspace, "slang_grad", like.shape, like))
    finite = torch.isfinite(grad.sum(-1))  # a NaN or an infinity anywhere makes a copy's sum non-finite
    if not bool(finite.all()):
        where = f" in stacked copy {int((~finite).nonzero()[0, 0])}" if finite.numel() > 1 else ""
        raise NonFiniteGradientError(f"method 'slang': non-finite gradient at step {step}{where}")
    try:
        update = low_rank_update(
            factors,
            layout,
            state.prec_factor,
            old_weight=1.0 - beta,
            new_weight=beta * scale,
            factor_gram=cache.factor_gram,
            factor_sqnorms=cache.factor_sqnorms,
            out=state.prec_factor if inplace else None,
            sqnorms_out=cache.factor_sqnorms if inplace else None,
            workspace=workspace,
            grad_sum=grad,
        )
    except FloatingPointError as err:
        raise NonFiniteGradientError(f"method 'slang': non-finite gradient at step {step} ({err})") from err
    grad.mul_(scale)  # g_hat
    # eq. (9): d = (1 - beta) d + beta lambda + max(correction, 0)
    prec_diag = state.prec_diag.mul_(1.0 - beta) if inplace else state.prec_diag * (1.0 - beta)
    prec_diag.add_(prior_precision, alpha=beta).add_(update.diag_residual.clamp_min_(0.0))
    new_momentum = state.momentum.mul_(momentum) if inplace else state.momentum * momentum
    new_momentum.add_(grad, alpha=1.0 - momentum)
    direction = torch.div(
        new_momentum, 1.0 - momentum**step, out=workspace_buffer(workspace, "slang_dir", like.shape, like)
    )
    direction.addcmul_(prior_precision, state.mean)  # bias-corrected momentum + lambda mu
    # eq. (11) by Woodbury, with U^T D^{-1} U and U^T D^{-1} direction in one blocked pass over U
    inv_diag = torch.reciprocal(prec_diag, out=workspace_buffer(workspace, "slang_inv_diag", like.shape, like))
    u = update.prec_factor
    capacitance, proj = weighted_gram(u, inv_diag, direction, workspace=workspace)
    assert proj is not None
    chol = capacitance_cholesky(capacitance)
    inner = torch.cholesky_solve(proj[..., None], chol)  # (R, L, 1)
    if u.shape[0] > 1 or u.shape[-1] == 1:  # direction - U inner; broadcast products for small stacks
        direction.sub_(thin_matmul(u, inner)[..., 0])
    else:
        direction[..., None].baddbmm_(u, inner, alpha=-1.0)
    mean = state.mean if inplace else state.mean.clone()
    mean.addcmul_(direction, inv_diag, value=-lr)  # mu - lr D^{-1}(direction - U inner)
    new_state = SlangState(mean=mean, prec_factor=u, prec_diag=prec_diag, momentum=new_momentum, step=step)
    new_cache = PrecisionCache(
        factor_gram=torch.diag_embed(update.eigenvalues),
        factor_sqnorms=update.factor_sqnorms,
        capacitance=capacitance,
        capacitance_chol=chol,
    )
    return new_state, new_cache


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """The dot products of the rows of ``a`` and ``b`` ``(R, n)``, ``(R,)``: without a temporary for one row."""
    return torch.dot(a[0], b[0])[None] if a.shape[0] == 1 else (a * b).sum(-1)


@register_method("slang")
class Slang(StackedMethod):
    """SLANG (Mishkin et al. 2018, Alg. 1; the update is in the module docstring) for networks of ``nn.Linear``
    layers: ``rank`` L (1 <= L < D), ``lr`` :math:`\\alpha`, ``beta`` :math:`\\beta`, ``decay`` :math:`\\gamma`
    (0: constant rates), ``beta_decay`` (β's own exponent; ``None``: ``decay``'s), ``momentum`` :math:`\\rho`
    (0: none), ``n_train_mc_samples`` S and ``init_prec_diag`` :math:`d_0`, each checked against ``option_ranges``."""

    option_ranges = MappingProxyType(
        {
            "rank": COUNT,
            "lr": POSITIVE,
            "beta": Range(0, 1, low_open=True),
            "decay": Range(0),
            "beta_decay": Range(0, nullable=True),
            "momentum": Range(0, 1, high_open=True),
            "n_train_mc_samples": COUNT,
            "init_prec_diag": POSITIVE,
        }
    )
    copy_state: ClassVar[tuple[str, ...]] = ("state", "cache", "prior_precision", "_log_prior_det")
    state: SlangState
    cache: PrecisionCache | None  # of ``state`` (None: rebuilt when needed, after a load)
    prior_precision: Tensor  # (R, D): each copy's λ

    def __init__(
        self,
        *,
        rank: int,
        lr: float,
        beta: float,
        decay: float,
        momentum: float,
        n_train_mc_samples: int,
        init_prec_diag: float,
        beta_decay: float | None = None,
    ) -> None:
        self.keep_options(locals())
        if self.beta_decay is None:
            self.beta_decay = self.decay

    # ------------------------------------------------------------------------------ set-up
    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """Start every copy from :math:`\\mu_0` = the model's parameters, :math:`U_0 = 0`, :math:`d_0` =
        ``init_prec_diag``.

        Raises:
            ValueError: if the model is not an ``nn.Sequential`` of ``nn.Linear`` and parameter-free
                modules, or if the rank L is not in 1 <= L < D.
        """
        super().setup_stack(problems)
        self.layout: LinearLayout = linear_layout(self.problem.model)
        n_params = self.layout.n_params
        if not 1 <= self.rank < n_params:
            raise ConfigError(
                f"slang: rank L={self.rank} must satisfy 1 <= L < D={n_params} (D = number of model parameters)"
            )
        mean, self.prior_precision = self.stacked_start()  # (R, D) each
        shared = uniform_value(self.prior_precision)  # one number when all entries share it: fewer passes
        self._shared_prior = shared if isinstance(shared, float) else None
        self._log_prior_det = self.prior_precision.log().sum(-1)  # (R,)
        n_copies = len(problems)
        self.state = SlangState(
            mean=mean,
            prec_factor=mean.new_zeros(n_copies, self.rank, n_params).mT,  # column-major
            prec_diag=torch.full_like(mean, self.init_prec_diag),
            momentum=torch.zeros_like(mean),
            step=0,
        )
        self.cache = None
        self._workspace: dict[str, Tensor] = {}  # scratch buffers reused by every train_step

    def _cache(self) -> PrecisionCache:
        """The cache of ``self.state`` (kept from the last update, or rebuilt after a load)."""
        if self.cache is None:
            self.cache = build_cache(self.state.prec_factor, self.state.prec_diag)
        return self.cache

    # ---------------------------------------------------------------------------- fitting
    @torch.no_grad()
    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One update of every copy on its minibatch (``x`` ``(R, M, in)``, ``y`` ``(R, M)``; module docstring),
        in place; the reported losses are ``(R,)`` tensors on the parameters' device.

        Raises:
            NonFiniteGradientError: naming the step (and the copy of a stack), if a per-example gradient is
                not finite (the state is then left as it was before the step).
        """
        problem, state = self.problem, self.state
        step = state.step + 1
        cache = self._cache()
        work, like = self._workspace, state.mean
        noise = sample_noise(  # (R, S, D), in the workspace
            state.prec_factor, state.prec_diag, cache, self.n_train_mc_samples, problem.generator, work
        )
        thetas = torch.add(state.mean[:, None], noise, out=workspace_buffer(work, "slang_thetas", noise.shape, like))
        likelihoods = [p.likelihood for p in self._copy_problems]
        factors = stacked_factors(problem.model, self.layout, thetas, x, y, likelihoods, share_first_input=True)
        # Per-example negative ELBO of q_t: nll + KL/N, the KL's trace term estimated by the samples.
        n_copies = like.shape[0]
        if n_copies == 1:  # logarithms of products of entries (sum_log), in the scratch free until slang_update
            log_diag = sum_log(state.prec_diag[0], workspace_buffer(work, "slang_dir", like.shape, like)[0])[None]
        else:
            log_diag = state.prec_diag.log().sum(-1)
        logdet = log_diag + 2.0 * cache.capacitance_chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        lam, flat = self._shared_prior, noise.view(n_copies, -1)  # (R, S D)
        if lam is not None:  # trace and Mahalanobis term as dot products, no lambda-weighted pass
            trace = _row_dots(flat, flat).mul_(lam / noise.shape[1])
            maha = _row_dots(like, like).mul_(lam)
        else:
            lam = self.prior_precision
            trace = (noise.square_() @ lam[..., None]).view(n_copies, -1).mean(-1)  # noise is not needed any more
            maha = _row_dots(lam * like, like)
        kl_est = 0.5 * (trace + maha - like.shape[-1] + logdet - self._log_prior_det)
        nll = factors.losses.mean(dim=(1, 2))  # (R,) tensors: read once per epoch by the fit loop, not per step
        kl_per_example = kl_est / problem.n_data
        self.state, self.cache = slang_update(
            state,
            cache,
            factors,
            self.layout,
            n_data=problem.n_data,
            prior_precision=self.prior_precision,
            lr=decayed_rate(self.lr, self.decay, step),
            beta=decayed_rate(self.beta, self.beta_decay, step),
            momentum=self.momentum,
            inplace=True,
            workspace=work,
        )
        return {"loss": nll + kl_per_example, "nll": nll, "kl": kl_per_example}

    # ------------------------------------------------------------------------- prediction
    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """Outputs of ``n_samples`` networks :math:`\\theta \\sim q`: ``(S, N, out)``."""
        model, s = self.problem.model, self.state
        mean = self.only_copy(s.mean)

        def draw(count: int) -> Tensor:
            thetas = mean + sample_noise(s.prec_factor, s.prec_diag, self._cache(), count, self.problem.generator)[0]
            return torch.func.vmap(lambda theta: forward_with(model, theta, x))(thetas)

        return in_chunks(n_samples, draw)

    def posterior(self) -> LowRankPlusDiagGaussian:
        """:math:`q = \\mathcal N(\\mu, (UU^\\top + \\operatorname{diag} d)^{-1})` (a copy: training updates the state in place)."""
        s = self.state
        return LowRankPlusDiagGaussian(*(self.only_copy(t).clone() for t in (s.mean, s.prec_factor, s.prec_diag)))

    @torch.no_grad()
    def kl_to_prior(self) -> Tensor:
        """Exact KL(q ‖ N(0, diag(λ)⁻¹)) (determinant lemma and Woodbury, O(D L²))."""
        s = self.state
        q = LowRankPlusDiagGaussian(*(self.only_copy(t) for t in (s.mean, s.prec_factor, s.prec_diag)))
        return kl(q, DiagGaussian(torch.zeros_like(q.mean), self.only_copy(self.prior_precision)))

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The state's tensors and the carried :class:`PrecisionCache` (so a resumed run continues
        bit for bit: rebuilding the cache from U and d rounds differently from carrying it)."""
        s, cache = self.state, self._cache()
        return {
            **{name: getattr(s, name).clone() for name in ("mean", "prec_factor", "prec_diag", "momentum")},
            "step": s.step,
            "cache": {f.name: getattr(cache, f.name).clone() for f in fields(cache)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (tensors are moved to the current state's device and dtype); a
        single run's checkpoint written before a single run was a stack of one copy (``(D,)`` tensors) too.

        Raises:
            ValueError: if a tensor's shape differs from the current state's.
        """
        current = self.state
        unstacked = torch.as_tensor(state["mean"]).ndim == 1

        def read(value: Any) -> Tensor:
            value = torch.as_tensor(value)
            return value[None] if unstacked else value

        tensors = {}
        for name in ("mean", "prec_factor", "prec_diag", "momentum"):
            value, expected = read(state[name]), getattr(current, name)
            if value.shape != expected.shape:
                raise ValueError(
                    f"slang: checkpoint {name} has shape {tuple(value.shape)}, expected {tuple(expected.shape)}"
                )
            tensors[name] = torch.empty_like(expected).copy_(value)  # keeps the state's layout
        self.state = SlangState(**tensors, step=int(state["step"]))
        like = current.prec_diag
        # copies: the cache's factor_sqnorms is overwritten in place by the next step
        saved = state.get("cache")
        self.cache = (
            None if saved is None else PrecisionCache(**{k: read(v).to(like, copy=True) for k, v in saved.items()})
        )

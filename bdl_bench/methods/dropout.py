r"""MC dropout (Gal & Ghahramani, 2016) with Adam, as in Gal's UCI code (yaringal/DropoutUncertaintyExps).

Dropout with rate p multiplies the input of every ``nn.Linear`` layer but the first by an independent mask
:math:`m / (1 - p)`, :math:`m \sim \mathrm{Bernoulli}(1 - p)` (inverted dropout, as Keras), drawn per example
and unit; ``dropout_inputs=True`` drops the network inputs too (Gal's ``net/net.py`` puts a ``Dropout``
before every ``Dense`` layer). Masks come from ``problem.generator`` only: the forward pass is written here
over the ``nn.Sequential``'s layers, skipping any ``nn.Dropout`` modules of the model.

Models with other parametrised layers (DEF's ``lenet``) run module by module, with dropout applied at the
model's own top-level ``nn.Dropout`` modules (``model.dropout=p``; their rate must equal ``dropout_rate``),
masks again from ``problem.generator`` per example, sample and unit. The modules before the first dropout
run once per minibatch, not once per mask draw.

Objective per training example, on a minibatch B of size M with S = ``n_train_mc_samples`` mask draws:

.. math::

    \mathcal L(\theta) = \frac1M \sum_{i \in B} \frac1S \sum_{s=1}^S -\log p(y_i \mid f(x_i; \theta, m_{s,i}))
        + \frac1{2N} \sum_d \lambda_d \theta_d^2,

with :math:`\lambda` = ``problem.prior_precision``. For a Gaussian likelihood of precision :math:`\tau` this
is Gal & Ghahramani's objective (2016, Eq. 1 and Sec. 4) times :math:`\tau`: their weight decay
:math:`\lambda_{wd} = l^2 (1 - p) / (2 N \tau)` corresponds to :math:`\lambda_d = l^2 (1 - p)` (their UCI code's
setting: docs/running.md). ``predict`` averages over stochastic forward passes with fresh masks.

**Stacked copies**: ``theta`` ``(R, D)`` under one Adam. Every mask is drawn once, with a single run's shape,
and shared by the copies, copy r keeping the units whose uniform draw is at least its own rate (the trials
of Gal's grid differ in ``dropout_rate``), so copy r draws exactly a single run's masks. Models with other
parametrised layers run as a single run only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from bdl_bench.curvature.products import stacked_linear
from bdl_bench.errors import ConfigError
from bdl_bench.likelihoods import stacked_nll
from bdl_bench.methods._shared import add_prior_term
from bdl_bench.methods.base import CannotStack, Problem, StackedMethod, register_method
from bdl_bench.models.params import unflatten, unflatten_stacked
from bdl_bench.optim import adam
from bdl_bench.ranges import COUNT, POSITIVE, UNIT_OPEN

_PREDICT_CHUNK = 64  # mask draws per chunk of ``predict``
_PREDICT_BUDGET = 2**16  # module-wise path: (mask draws x examples) per forward pass in ``predict``
_SLICE_ELEMENTS = 2**19  # predict: (mask draws x examples x widest layer) per slice, 2 MB in float32
_PREFIX_ROWS = 1024  # module-wise path: examples per pass through the deterministic modules in ``predict``


@register_method("dropout")
class MCDropout(StackedMethod):
    """MC dropout trained with Adam (see the module docstring)."""

    per_copy_options = ("dropout_rate",)  # stacked trials of Gal's grid: one rate per copy
    option_ranges = MappingProxyType({"lr": POSITIVE, "dropout_rate": UNIT_OPEN, "n_train_mc_samples": COUNT})
    copy_state = ("theta",)
    adam_leaves = ("theta",)
    iid_predictive = True  # each sample an independent draw of the masks

    def __init__(self, *, lr: float, dropout_rate: float, n_train_mc_samples: int, dropout_inputs: bool) -> None:
        self.keep_options(locals())
        if not isinstance(dropout_inputs, bool):
            raise ConfigError(f"dropout: dropout_inputs must be true or false, got {dropout_inputs!r}")
        self.dropout_inputs = dropout_inputs

    def setup_stack(self, problems: Sequence[Problem]) -> None:
        """R copies from the model's parameters: ``theta`` ``(R, D)``, one Adam over it (an ``nn.Sequential``
        model; :class:`CannotStack` for R > 1 copies of one with layers other than ``nn.Linear``)."""
        super().setup_stack(problems)
        model = self.problem.model
        if not isinstance(model, nn.Sequential):
            raise ConfigError(f"dropout: needs an nn.Sequential model, got {type(model).__name__}")
        others = [
            (name, module)
            for name, module in model.named_children()
            if not isinstance(module, nn.Linear) and any(True for _ in module.parameters())
        ]
        self._linear_only = not others
        if not self._linear_only:
            self._check_dropout_modules(model, others[0])
            if len(problems) > 1:
                raise CannotStack("dropout: stacked splits need a model of nn.Linear layers")
        rates = [float(p) for p in self.copy_values("dropout_rate")]
        if not all(0 < p < 1 for p in rates):
            raise ConfigError(f"dropout: dropout_rate must satisfy 0 < p < 1, got {rates}")
        self.theta, self._prior = self.stacked_start()  # (R, D) each
        self.theta.requires_grad_(True)
        self._per_copy(rates, self.theta)
        self.optimizer = adam([self.theta], self.lr)

    def _per_copy(self, rates: list[float], like: Tensor) -> None:
        """The copies' constants: their dropout rates ``_rates``, for the masks either ``_shared_rate`` (one rate
        for all copies: a single run's mask serves them all) or ``_rate_tensor`` ``(R,)``, and ``_ones`` ``(R,)``."""
        self._rates = rates
        self._shared_rate = rates[0] if len(set(rates)) == 1 else None
        self._rate_tensor = torch.tensor(rates, dtype=like.dtype, device=like.device)
        self._ones = torch.ones(len(rates), dtype=like.dtype, device=like.device)

    def copy_at(self, index: int) -> MCDropout:
        single: MCDropout = super().copy_at(index)  # type: ignore[assignment]
        single._per_copy([single.dropout_rate], single.theta)
        single._prior = self._prior[index : index + 1]
        return single

    def _check_dropout_modules(self, model: nn.Sequential, first_other: tuple[str, nn.Module]) -> None:
        """The module-wise path's requirements (module docstring)."""
        name, module = first_other
        sites = [(n, m) for n, m in model.named_children() if isinstance(m, nn.modules.dropout._DropoutNd)]
        if not sites:
            raise ConfigError(
                f"dropout: layer {name} is {type(module).__name__}, not nn.Linear; for such models dropout is applied "
                "at the model's own nn.Dropout modules, and this model has none (set model.dropout=<rate>)"
            )
        for n, m in sites:
            if type(m) is not nn.Dropout:
                raise ConfigError(
                    f"dropout: layer {n} is {type(m).__name__}; only element-wise nn.Dropout is supported"
                )
            if not math.isclose(m.p, self.dropout_rate, rel_tol=1e-12, abs_tol=0.0):
                raise ConfigError(
                    f"dropout: the model's nn.Dropout (layer {n}) has rate {m.p} but method.dropout_rate="
                    f"{self.dropout_rate}; set them equal (method.dropout_rate=${{model.dropout}})"
                )
        for n, child in model.named_children():
            if not isinstance(child, nn.modules.dropout._DropoutNd) and any(
                isinstance(sub, nn.modules.dropout._DropoutNd) for sub in child.modules()
            ):
                raise ConfigError(f"dropout: layer {n} ({type(child).__name__}) holds a dropout module inside it")

    def _masks(self, shape: Sequence[int], like: Tensor) -> Tensor:
        r"""Every copy's inverted-dropout mask :math:`m/(1 - p_r)`, :math:`m = [u \ge p_r]`, from one uniform
        draw u of ``shape`` (a single run's): ``shape`` itself where the copies share their rate, else
        ``(R, *shape)``."""
        u = self._uniform(shape, like)
        if self._shared_rate is not None:
            return u.ge_(self._shared_rate).div_(1 - self._shared_rate)
        rates = self._rate_tensor.view(-1, *([1] * len(shape)))
        return (u >= rates).to(u.dtype).div_(1 - rates)

    def _scaled_masks(self, shape: Sequence[int], like: Tensor, rates: Sequence[float]) -> dict[float, Tensor]:
        """:meth:`_masks` for each distinct rate of ``rates``, all from one uniform draw."""
        u = self._uniform(shape, like)
        distinct = list(dict.fromkeys(rates))
        if len(distinct) == 1:
            return {distinct[0]: u.ge_(distinct[0]).div_(1 - distinct[0])}
        return {p: u.ge(p).to(u.dtype).div_(1 - p) for p in distinct}

    def _uniform(self, shape: Sequence[int], like: Tensor) -> Tensor:
        """U(0, 1) numbers of ``shape`` from the method's generator, in ``like``'s dtype and on its device."""
        g = self.problem.generator
        return torch.rand(shape, generator=g, device=g.device, dtype=like.dtype).to(like.device)

    def _outputs(self, x: Tensor, n_samples: int) -> Tensor:
        """Every copy's network outputs on its inputs ``x`` ``(R, M, in)`` under ``n_samples`` mask draws, draw by
        draw: ``(R, S·M, out)`` (models of ``nn.Linear`` layers)."""
        model = self.problem.model
        n_copies = x.shape[0]
        # a single run's weights are 2-d: its GEMMs give the weight gradients in the parameters' own layout
        params = unflatten(model, self.theta.view(-1)) if n_copies == 1 else unflatten_stacked(model, self.theta)
        h = x if n_samples == 1 else x.repeat(1, n_samples, 1)  # (R, S·M, in): the minibatch once per mask draw
        first = True
        for name, module in model.named_children():
            if isinstance(module, nn.Linear):
                if not first or self.dropout_inputs:
                    h = h * self._masks(h.shape[1:], h)  # each (S, M, in) mask draw of a single run, flattened
                first = False
                weight, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
                h = F.linear(h, weight, bias) if weight.dim() == 2 else stacked_linear(h, weight, bias)
            elif not isinstance(module, nn.modules.dropout._DropoutNd):
                h = module(h)
        return h

    def stack_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Adam on the sum of the copies' objectives (each copy's gradient is its own objective's)."""
        self.optimizer.zero_grad(set_to_none=True)
        n_samples = self.n_train_mc_samples
        if self._linear_only:
            f = self._outputs(x, n_samples)  # (R, S·M, out)
        else:  # a single run (setup_stack), module by module
            params = self._module_params(self.theta.view(-1))
            f = self._stochastic_part(params, self._deterministic_part(params, x[0]), n_samples)
            f = f.flatten(0, 1).unsqueeze(0)
        y = y if n_samples == 1 else y.repeat(1, n_samples)  # (R, S·M): the targets of each draw's outputs
        nll = stacked_nll([q.likelihood for q in self._copy_problems], f, y).mean(dim=1)  # (R,)
        nll.backward(self._ones)  # the gradient of the copies' sum: each copy's is its own objective's
        penalty = add_prior_term(self.theta, self._prior, self.problem.n_data)  # (R,)
        self.optimizer.step()
        nll = nll.detach()
        return {"loss": nll + penalty, "nll": nll}

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``n_samples`` stochastic forward passes with dropout active: ``(S, N, out)``."""
        theta = self.only_copy(self.theta.detach())
        if not self._linear_only:
            return self._predict_module_wise(theta, x, n_samples)
        return self.predict_stack(x.unsqueeze(0), n_samples, [0])[0]

    @torch.no_grad()
    def predict_stack(self, x: Tensor, n_samples: int, copies: Sequence[int]) -> Tensor:
        """:meth:`predict` of the stacked copies ``copies`` on their inputs ``x`` ``(len(copies), N, in)``:
        ``(len(copies), S, N, out)``, copy r's slice what ``self.copy_at(r).predict(x[r], S)`` returns (the
        generator left where that call leaves it). A single run's masks are drawn once per chunk and shared by
        the copies (one per distinct rate); each copy then runs a slice of the chunk at a time (in cache)."""
        if not self._linear_only:
            raise CannotStack("dropout: shared predictions need a model of nn.Linear layers")
        thetas = self.theta.detach().index_select(0, torch.tensor(list(copies), device=self.theta.device))
        rates = [self._rates[r] for r in copies]
        layers = [(name, m) for name, m in self.problem.model.named_children()]
        params = unflatten_stacked(self.problem.model, thetas)
        n_examples = x.shape[1]
        widest = max(max(m.in_features, m.out_features) for _, m in layers if isinstance(m, nn.Linear))
        rows = max(1, _SLICE_ELEMENTS // (n_examples * widest))
        chunks = []
        for start in range(0, n_samples, _PREDICT_CHUNK):
            size = min(_PREDICT_CHUNK, n_samples - start)
            masks, first = [], True  # each Linear's masks, drawn in the order training draws them
            for _, module in layers:
                if isinstance(module, nn.Linear):
                    drop = not first or self.dropout_inputs
                    first = False
                    shape = (size, n_examples, module.in_features)
                    masks.append(self._scaled_masks(shape, thetas, rates) if drop else None)
            out = None
            for c, rate in enumerate(rates):
                for lo in range(0, size, rows):  # a slice of the chunk's samples at a time (activations in cache)
                    hi = min(size, lo + rows)
                    h, linear = x[c].unsqueeze(0).expand(hi - lo, *x.shape[1:]), 0
                    for name, module in layers:
                        if isinstance(module, nn.Linear):
                            if masks[linear] is not None:
                                mask = masks[linear][rate][lo:hi]
                                h = h * mask if linear == 0 else h.mul_(mask)  # later inputs are this slice's own
                            linear += 1
                            bias = params.get(f"{name}.bias")
                            h = F.linear(h, params[f"{name}.weight"][c], None if bias is None else bias[c])
                        elif isinstance(module, nn.ReLU) and linear:  # h is this slice's own
                            h = h.relu_()
                        elif not isinstance(module, nn.modules.dropout._DropoutNd):
                            h = module(h)
                    if out is None:
                        out = h.new_empty(len(rates), size, *h.shape[1:])
                    out[c, lo:hi] = h
            chunks.append(out)
        return torch.cat(chunks, dim=1)

    # ------------------------------------------------------------------ module-wise path (conv models, R = 1)
    def _module_params(self, theta: Tensor) -> list[dict[str, Tensor]]:
        """``theta`` split per top-level module, keyed by the module's own parameter names."""
        params = unflatten(self.problem.model, theta)
        out: list[dict[str, Tensor]] = []
        for name, _ in self.problem.model.named_children():
            prefix = f"{name}."
            out.append({k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)})
        return out

    def _first_stochastic(self) -> int:
        """Index of the first top-level module that draws masks (0 with ``dropout_inputs``)."""
        if self.dropout_inputs:
            return 0
        return next(i for i, m in enumerate(self.problem.model.children()) if isinstance(m, nn.Dropout))

    def _apply(self, index: int, module: nn.Module, params: list[dict[str, Tensor]], h: Tensor) -> Tensor:
        if isinstance(module, nn.Dropout):
            return h * self._masks(h.shape, h)
        return functional_call(module, params[index], (h,)) if params[index] else module(h)

    def _deterministic_part(self, params: list[dict[str, Tensor]], x: Tensor) -> Tensor:
        """The modules before the first mask, once for all mask draws: ``(N, ...)``."""
        h = x
        for i, module in enumerate(list(self.problem.model.children())[: self._first_stochastic()]):
            h = self._apply(i, module, params, h)
        return h

    def _stochastic_part(self, params: list[dict[str, Tensor]], h: Tensor, n_samples: int) -> Tensor:
        """The remaining modules under ``n_samples`` mask draws of ``h`` ``(N, ...)``: ``(S, N, out)``."""
        n = h.shape[0]
        h = h.unsqueeze(0).expand(n_samples, *h.shape).reshape(n_samples * n, *h.shape[1:])
        start = self._first_stochastic()
        if self.dropout_inputs:
            h = h * self._masks(h.shape, h)
        for i, module in enumerate(list(self.problem.model.children())[start:], start=start):
            h = self._apply(i, module, params, h)
        return h.reshape(n_samples, n, *h.shape[1:])

    def _predict_module_wise(self, theta: Tensor, x: Tensor, n_samples: int) -> Tensor:
        """``predict`` of the module-wise path, in slices that bound the memory of a conv net on a test set."""
        params = self._module_params(theta)
        h = torch.cat([self._deterministic_part(params, xs) for xs in x.split(_PREFIX_ROWS)])
        chunks = []
        for start in range(0, n_samples, _PREDICT_CHUNK):
            s = min(_PREDICT_CHUNK, n_samples - start)
            rows = max(1, _PREDICT_BUDGET // s)
            chunks.append(torch.cat([self._stochastic_part(params, hs, s) for hs in h.split(rows)], dim=1))
        return torch.cat(chunks)

    def point_estimate(self) -> Tensor:
        """The trained weights (what a deterministic network with dropout switched off would use)."""
        return self.only_copy(self.theta.detach())

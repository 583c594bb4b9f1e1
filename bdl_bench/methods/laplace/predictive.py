r"""The predictives of a Gaussian posterior :math:`q = \mathcal N(\theta_{MAP}, P^{-1})` over a network's parameters.

``predictive: sample`` evaluates the network at posterior samples (Lee et al. 2020, eq. 7); ``predictive: linearised``
evaluates its first-order expansion :math:`f(x;\theta_{MAP}) + J(x)(\theta_s - \theta_{MAP})` at them, which also
has a closed form (:meth:`GaussianPredictive.predictive_moments`)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from bdl_bench.gaussians import StructuredGaussian
from bdl_bench.methods.base import Method
from bdl_bench.models.params import forward_with

_PREDICT_CHUNK = 64  # most posterior samples drawn at once
_SAMPLE_BUDGET = 2**24  # entries of the parameter samples drawn at once (samples x D): 64 MiB in float32
_PREDICT_BUDGET = 2**21  # activation entries (samples x examples x widest layer) per forward pass


class Predictive(str, Enum):
    """How ``predict`` turns parameter samples into output samples."""

    SAMPLE = "sample"  # the network at sampled parameters
    LINEARISED = "linearised"  # its first-order Taylor expansion around the MAP
    AUTO = "auto"  # at setup: linearised for regression (laplace-torch's default), sample for classification (DEF's)


class GaussianPredictive(Method):
    """Base of a method whose posterior is a ``StructuredGaussian`` centred at its parameters ``theta``: the
    predictives (module docstring). Before the posterior exists every sample is the MAP's output."""

    iid_predictive = True  # each sample an independent draw of the posterior (or the MAP's output, repeated)
    theta: Tensor
    predictive: Predictive
    _posterior: StructuredGaussian | None = None

    def posterior(self) -> StructuredGaussian | None:
        return self._posterior

    def point_estimate(self) -> Tensor:
        """:math:`\\theta_{MAP}` (the posterior's mean once it is fitted)."""
        return self.theta.detach()

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``(n_samples, N, out)`` outputs at posterior samples (the MAP's, repeated, before the posterior is fitted)."""
        return self.predict_sets({"x": x}, n_samples)["x"]

    @torch.no_grad()
    def predict_sets(self, sets: Mapping[str, Tensor], n_samples: int) -> dict[str, Tensor]:
        """:meth:`predict` on several inputs, with the same posterior samples for all of them."""
        return self.sample_sets(self._posterior, sets, n_samples, self.problem.generator)

    @torch.no_grad()
    def sample_sets(
        self,
        posterior: StructuredGaussian | None,
        sets: Mapping[str, Tensor],
        n_samples: int,
        generator: torch.Generator,
    ) -> dict[str, Tensor]:
        r"""Outputs ``(n_samples, N, out)`` per set at ``n_samples`` draws of ``posterior`` from ``generator``
        (``None``: the MAP's outputs, repeated), drawn in chunks of at most ``_SAMPLE_BUDGET`` parameter entries,
        each evaluated on every set before the next is drawn, in forward passes of at most ``_PREDICT_BUDGET``
        activation entries (on the CPU large fresh tensors cost page faults); images channels-last (faster
        convolutions)."""
        model, theta = self.problem.model, self.theta.detach()
        probe = next((x[:1] for x in sets.values() if x.shape[0] > 0), None)
        rows = 1 if probe is None else forward_rows(model, theta, probe)
        sets = {name: x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x for name, x in sets.items()}
        if posterior is None or probe is None:
            maps = {
                name: torch.cat([forward_with(model, theta, xs) for xs in x.split(rows)]) for name, x in sets.items()
            }
            return {name: f[None].expand(n_samples, *f.shape) for name, f in maps.items()}
        out_shape = forward_with(model, theta, probe).shape[1:]
        outs = {name: theta.new_empty(n_samples, x.shape[0], *out_shape) for name, x in sets.items()}
        chunk = max(1, min(_PREDICT_CHUNK, _SAMPLE_BUDGET // theta.numel()))
        for start in range(0, n_samples, chunk):
            thetas = posterior.rsample(min(chunk, n_samples - start), generator)
            for name, x in sets.items():
                self._outputs_at(thetas, x, rows, outs[name][start : start + len(thetas)])
        return outs

    def _outputs_at(self, thetas: Tensor, x: Tensor, rows: int, out: Tensor) -> None:
        """Write ``(S, N, out)`` outputs at the parameter samples ``thetas`` ``(S, D)`` into ``out``, in passes of
        at most ``rows`` (samples x examples): several samples vmapped over a small ``x``; else row slices, one
        sample at a time (``sample``) or all S at once around one shared MAP pass (``linearised``)."""
        per_pass = max(1, rows // max(1, x.shape[0]))  # samples per pass over the whole of x
        if per_pass == 1 and len(thetas) > 1 and self.predictive is Predictive.LINEARISED:
            step = max(1, rows // len(thetas))
            for r, xs in zip(range(0, x.shape[0], step), x.split(step)):
                out[:, r : r + len(xs)] = self._forward(thetas, xs)
            return
        for k, group in zip(range(0, len(thetas), per_pass), thetas.split(per_pass)):
            for r, xs in zip(range(0, x.shape[0], rows), x.split(rows)):
                out[k : k + len(group), r : r + len(xs)] = self._forward(group, xs)

    def _forward(self, thetas: Tensor, x: Tensor) -> Tensor:
        """One pass: ``(S, N, out)`` outputs at ``thetas`` ``(S, D)`` (per ``predictive``)."""
        model, theta = self.problem.model, self.theta.detach()
        if self.predictive is Predictive.SAMPLE:
            if len(thetas) == 1:
                return forward_with(model, thetas[0], x)[None]
            return vmap(lambda th: forward_with(model, th, x))(thetas)

        def linear(delta: Tensor) -> Tensor:  # under vmap the MAP pass (unbatched primal) runs once
            f0, jd = jvp(lambda th: forward_with(model, th, x), (theta,), (delta,))
            return f0 + jd

        if len(thetas) == 1:
            return linear(thetas[0] - theta)[None]
        return vmap(linear)(thetas - theta)

    @torch.no_grad()
    def predictive_moments(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        r"""The linearised predictive in closed form: :math:`f(x;\theta_{MAP})` and
        :math:`\operatorname{diag}(J\Sigma J^\top)` per example and output, ``(N, out)`` each (laplace-torch's
        ``pred_type="glm"``); with a Gaussian likelihood the predictive is exactly
        :math:`\mathcal N(f, \operatorname{diag}(J\Sigma J^\top) + \gamma^{-1})`. ``None`` for
        ``predictive: sample`` or before the posterior exists.
        The Jacobian rows are formed per example (vmapped; a Jacobian of a whole slice would hold slice²
        activations), :math:`\Sigma J^\top` by the posterior's ``solve``."""
        if self.predictive is not Predictive.LINEARISED or self._posterior is None:
            return None
        model, theta, posterior = self.problem.model, self.theta.detach(), self._posterior
        means, variances = [], []
        out_dim = int(forward_with(model, theta, x[:1]).shape[-1]) if x.shape[0] else 1
        rows = max(1, _SAMPLE_BUDGET // (theta.numel() * out_dim))

        def one(th: Tensor, xi: Tensor) -> Tensor:  # one example's outputs: Jacobians cost O(out·D) per example
            return forward_with(model, th, xi[None])[0]

        for xs in x.split(rows):
            mean = forward_with(model, theta, xs)  # (n, out)
            jac = vmap(jacrev(one), in_dims=(None, 0))(theta, xs).reshape(-1, theta.numel())  # per-example rows
            jac = jac.to(posterior.dtype)
            var = (jac * posterior.solve(jac.mT).mT).sum(-1).reshape(mean.shape)
            means.append(mean)
            variances.append(var.to(mean.dtype))
        return torch.cat(means), torch.cat(variances)


def forward_rows(model: nn.Module, theta: Tensor, x: Tensor) -> int:
    """How many examples of ``x`` one forward pass takes within ``_PREDICT_BUDGET`` activation entries."""
    return max(1, _PREDICT_BUDGET // widest_activation(model, theta, x[:1]))


def widest_activation(model: nn.Module, theta: Tensor, x: Tensor) -> int:
    """The most entries any module's output (or the input) has per example of ``x`` (one example)."""
    sizes = [x[0].numel()]

    def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, Tensor):
            sizes.append(output[0].numel() if output.ndim else 1)

    hooks = [module.register_forward_hook(record) for module in model.modules()]
    try:
        forward_with(model, theta, x[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return max(sizes)

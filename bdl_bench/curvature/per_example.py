r"""Per-example gradient factors of ``nn.Linear`` networks, without per-example gradients.

For a linear layer :math:`z = W a + b` the gradient of example i's loss :math:`\ell_i` is
:math:`\delta_i a_i^\top` for W and :math:`\delta_i` for b, where :math:`a_i` is the layer input and
:math:`\delta_i = \partial \ell_i / \partial z_i` the gradient at the layer's pre-activation output
(Goodfellow 2015, "Efficient per-example gradient computations"; Mishkin et al. 2018, App. C.1).
One batched forward and one backward of :math:`\sum_i \ell_i` give every :math:`a_i` and
:math:`\delta_i` (the loss of example i depends on its own row only, so the gradient of the sum
with respect to row i of z is :math:`\delta_i`). Products with the D x P matrix
:math:`G = [g_1 \dots g_P]` are then formed layer by layer (:mod:`bdl_bench.curvature.gram`);
G itself is never built.

Monte Carlo samples: :func:`linear_factors` evaluates the network at S parameter vectors
:math:`\theta_1 \dots \theta_S` at once and returns P = S·M columns, sample-major (column
``s * M + i`` is example i at :math:`\theta_s`).

The flat parameter order is that of ``bdl_bench.models.params``: ``model.parameters()`` order, each
``nn.Linear`` contributing its weight ``(out, in)`` row-major, then its bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bdl_bench.likelihoods import Likelihood
from bdl_bench.models.params import n_params, sequential_layers


@dataclass(frozen=True)
class LinearSlot:
    """Where one ``nn.Linear`` layer sits in the model and in the flat parameter vector.

    Attributes:
        module_index: position of the layer in the ``nn.Sequential``.
        in_features: width of the layer input a.
        out_features: width of the pre-activation output z.
        weight_offset: index of ``weight[0, 0]`` in the flat vector (the weight is row-major).
        bias_offset: index of ``bias[0]``, or ``None`` for a layer without bias.
    """

    module_index: int
    in_features: int
    out_features: int
    weight_offset: int
    bias_offset: int | None

    @property
    def weight_slice(self) -> slice:
        return slice(self.weight_offset, self.weight_offset + self.out_features * self.in_features)

    @property
    def bias_slice(self) -> slice | None:
        if self.bias_offset is None:
            return None
        return slice(self.bias_offset, self.bias_offset + self.out_features)


@dataclass(frozen=True)
class LinearLayout:
    """The ``nn.Linear`` layers of an ``nn.Sequential`` and the size D of its flat parameter vector."""

    slots: tuple[LinearSlot, ...]
    n_params: int


def linear_layout(model: nn.Module) -> LinearLayout:
    """Locate every ``nn.Linear`` layer of ``model`` in the flat parameter vector.

    Args:
        model: an ``nn.Sequential`` whose modules are ``nn.Linear`` layers and parameter-free modules
            that act on each example separately (activations, dropout with rate 0).

    Returns:
        The :class:`LinearLayout`.

    Raises:
        ValueError: if ``model`` is not an ``nn.Sequential``, holds a parametrised module other than
            ``nn.Linear``, uses one ``nn.Linear`` twice, or has no ``nn.Linear`` layer.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"per-example factors need an nn.Sequential model, got {type(model).__name__}")
    slots = []
    seen: set[int] = set()
    for index, module, layer in sequential_layers(model):
        if isinstance(module, nn.Linear) and layer is not None:
            if id(module) in seen:
                raise ValueError(
                    f"per-example factors need distinct layers; module {index} reuses an earlier nn.Linear"
                )
            seen.add(id(module))
            slots.append(
                LinearSlot(
                    index, module.in_features, module.out_features, layer.slices["weight"].start, layer.offset("bias")
                )
            )
        elif any(True for _ in module.parameters()):
            raise ValueError(
                f"per-example factors handle nn.Linear layers and parameter-free modules only; "
                f"module {index} is {type(module).__name__}"
            )
    if not slots:
        raise ValueError("per-example factors need at least one nn.Linear layer")
    return LinearLayout(slots=tuple(slots), n_params=n_params(model))


@dataclass(frozen=True)
class LayerFactors:
    """Inputs and output gradients of one linear layer, one row per column of G.

    Attributes:
        slot: the layer's place in the flat vector.
        inputs: :math:`a_i`, shape ``(P, in)``.
        output_grads: :math:`\\delta_i = \\partial\\ell_i/\\partial z_i`, shape ``(P, out)``.
    """

    slot: LinearSlot
    inputs: Tensor  # (P, in)
    output_grads: Tensor  # (P, out)


@dataclass(frozen=True)
class PerExampleFactors:
    """Everything needed to multiply with the per-example gradient matrix G (D x P).

    Column p of G is :math:`g_p = \\nabla_\\theta \\ell_p`, where for ``P = S * M`` columns
    ``p = s * M + i`` is example i evaluated at the s-th parameter vector.

    Attributes:
        layers: one :class:`LayerFactors` per ``nn.Linear`` layer, in model order.
        n_params: D.
        losses: :math:`\\ell` (the likelihood's per-example nll), shape ``(S, M)``, detached.
        outputs: the network outputs, shape ``(S, M, out)``, detached.
    """

    layers: tuple[LayerFactors, ...]
    n_params: int
    losses: Tensor  # (S, M)
    outputs: Tensor  # (S, M, out)

    @property
    def n_columns(self) -> int:
        """P = S·M, the number of per-example gradients."""
        return self.losses.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.losses.dtype

    @property
    def device(self) -> torch.device:
        return self.losses.device

    def grad_sum(self, out: Tensor | None = None) -> Tensor:
        """:math:`\\sum_p g_p = G\\mathbf 1`, shape ``(D,)`` (one GEMM per layer: :math:`\\Delta^\\top A`),
        into ``out`` if given."""
        if out is None:
            out = torch.empty(self.n_params, dtype=self.dtype, device=self.device)  # the layers cover every entry
        for layer in self.layers:
            slot = layer.slot
            weight = out[slot.weight_slice].view(slot.out_features, slot.in_features)
            torch.mm(layer.output_grads.mT, layer.inputs, out=weight)
            if slot.bias_slice is not None:
                torch.sum(layer.output_grads, 0, out=out[slot.bias_slice])
        return out

    def dense(self) -> Tensor:
        """The materialised matrix G, shape ``(D, P)``: O(D·P) memory, for tests on small D only."""
        grads = torch.zeros(self.n_columns, self.n_params, dtype=self.dtype, device=self.device)
        for layer in self.layers:
            slot = layer.slot
            outer = layer.output_grads[:, :, None] * layer.inputs[:, None, :]  # (P, out, in)
            grads[:, slot.weight_slice] = outer.reshape(self.n_columns, -1)
            if slot.bias_slice is not None:
                grads[:, slot.bias_slice] = layer.output_grads
        return grads.mT


def linear_factors(
    model: nn.Module,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    layout: LinearLayout | None = None,
) -> PerExampleFactors:
    """Layer inputs and output gradients of :math:`\\sum_{s,i} \\ell(f(x_i; \\theta_s), y_i)`.

    The network is evaluated layer by layer with weights sliced from ``theta`` (the model's own
    parameters are not used), then one backward pass gives the gradients at every pre-activation.

    Args:
        model: an ``nn.Sequential`` of ``nn.Linear`` and parameter-free modules (see
            :func:`linear_layout`).
        theta: flat parameters, ``(D,)`` or ``(S, D)`` for S Monte Carlo samples.
        x: inputs ``(M, in)``.
        y: targets ``(M,)``.
        likelihood: gives the per-example loss :math:`\\ell_i = -\\log p(y_i \\mid f_i)`.
        layout: ``linear_layout(model)``, to skip recomputing it.

    Returns:
        The :class:`PerExampleFactors` with P = S·M columns (sample-major).

    Raises:
        ValueError: if ``theta`` does not have D entries per row.
    """
    layout = linear_layout(model) if layout is None else layout
    thetas = theta.detach()
    if thetas.ndim == 1:
        thetas = thetas.unsqueeze(0)
    if thetas.ndim != 2 or thetas.shape[1] != layout.n_params:
        raise ValueError(f"theta must have shape (D,) or (S, D) with D={layout.n_params}, got {tuple(theta.shape)}")
    n_samples, n_examples = thetas.shape[0], x.shape[0]
    n_cols = n_samples * n_examples
    x = x.to(thetas.dtype)
    slot_of = {slot.module_index: slot for slot in layout.slots}

    inputs: list[Tensor] = []
    pre_activations: list[Tensor] = []
    with torch.enable_grad():
        h = x.unsqueeze(0).expand(n_samples, *x.shape)  # (S, M, in)
        for index, module in enumerate(model):
            slot = slot_of.get(index)
            if slot is None:
                h = module(h.reshape(n_cols, -1)).reshape(n_samples, n_examples, -1)
                continue
            weight = thetas[:, slot.weight_slice].view(n_samples, slot.out_features, slot.in_features)
            if slot.bias_slice is None:
                z = torch.bmm(h, weight.mT)
            else:
                z = torch.baddbmm(thetas[:, slot.bias_slice].unsqueeze(1), h, weight.mT)
            if not z.requires_grad:  # the first layer: make its output the root of the graph
                z.requires_grad_(True)
            inputs.append(h.reshape(n_cols, slot.in_features))
            pre_activations.append(z)
            h = z
        losses = likelihood.nll(h.reshape(n_cols, -1), y.repeat(n_samples))  # (S·M,)
        grads = torch.autograd.grad(losses.sum(), pre_activations)
    layers = tuple(
        LayerFactors(slot=slot, inputs=a.detach(), output_grads=g.reshape(n_cols, slot.out_features))
        for slot, a, g in zip(layout.slots, inputs, grads)
    )
    return PerExampleFactors(
        layers=layers,
        n_params=layout.n_params,
        losses=losses.detach().view(n_samples, n_examples),
        outputs=h.detach(),
    )

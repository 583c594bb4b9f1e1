r"""Per-example gradient factors of ``nn.Linear`` networks, without per-example gradients.

For a linear layer :math:`z = W a + b` the gradient of example i's loss :math:`\ell_i` is
:math:`\delta_i a_i^\top` for W and :math:`\delta_i` for b, where :math:`a_i` is the layer input and
:math:`\delta_i = \partial \ell_i / \partial z_i` the gradient at the layer's pre-activation output
(Goodfellow 2015, "Efficient per-example gradient computations"; Mishkin et al. 2018, App. C.1).
One batched forward and one backward of :math:`\sum_i \ell_i` give every :math:`a_i` and
:math:`\delta_i` (the loss of example i depends on its own row only, so the gradient of the sum
with respect to row i of z is :math:`\delta_i`): :func:`bdl_bench.curvature.stacked.stacked_factors`, for
R stacked copies at S parameter vectors each (P = S·M columns, sample-major). Products with the D x P
matrix :math:`G = [g_1 \dots g_P]` are then formed layer by layer (:mod:`bdl_bench.curvature.gram`);
G itself is never built. This module locates the layers in the flat parameter vector.

The flat parameter order is that of ``bdl_bench.models.params``: ``model.parameters()`` order, each
``nn.Linear`` contributing its weight ``(out, in)`` row-major, then its bias.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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

r"""Per-example gradient factors of ``nn.Linear`` networks, without per-example gradients.

For a linear layer :math:`z = W a + b` the gradient of example i's loss :math:`\ell_i` is
:math:`\delta_i a_i^\top` for W and :math:`\delta_i` for b, where :math:`a_i` is the layer input and
:math:`\delta_i = \partial \ell_i / \partial z_i` the gradient at the layer's pre-activation output
(Goodfellow 2015, "Efficient per-example gradient computations"; Mishkin et al. 2018, App. C.1).
One batched forward and one backward of :math:`\sum_i \ell_i` give every :math:`a_i` and
:math:`\delta_i` (the loss of example i depends on its own row only):
:func:`bdl_bench.curvature.stacked.stacked_factors`. Products with the D x P matrix
:math:`G = [g_1 \dots g_P]` are then formed layer by layer (:mod:`bdl_bench.curvature.gram`); G itself is
never built. This module locates the layers in the flat parameter vector (the slots of
:func:`~bdl_bench.curvature.pseudo_grads.kron_layout`, without convolutions).
"""

from __future__ import annotations

from torch import nn

from bdl_bench.curvature.pseudo_grads import KronLayout, kron_layout

LinearLayout = KronLayout  # every slot's ``conv`` is None


def linear_layout(model: nn.Module) -> LinearLayout:
    """Locate every ``nn.Linear`` layer of an ``nn.Sequential`` of them and parameter-free modules that act on
    each example separately (activations, dropout with rate 0)."""
    return kron_layout(model, convolutions=False)

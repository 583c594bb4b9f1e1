r"""Where the ``nn.Linear`` layers of a network sit in the flat parameter vector, for per-example gradient
factors: example i's gradient is :math:`\delta_i a_i^\top` for W and :math:`\delta_i` for b of a layer
:math:`z = Wa + b` (Goodfellow 2015; Mishkin et al. 2018, App. C.1), whose :math:`a_i`, :math:`\delta_i`
:func:`bdl_bench.curvature.stacked.stacked_factors` computes.
"""

from __future__ import annotations

from torch import nn

from bdl_bench.curvature.pseudo_grads import KronLayout, kron_layout

LinearLayout = KronLayout  # every slot's ``conv`` is None


def linear_layout(model: nn.Module) -> LinearLayout:
    """Locate every ``nn.Linear`` layer of an ``nn.Sequential`` of them and parameter-free modules that act on
    each example separately (activations, dropout with rate 0)."""
    return kron_layout(model, convolutions=False)

"""Curvature of networks from layer inputs and output gradients, never from per-example gradient matrices.

SLANG and VOGN: ``per_example`` locates the ``nn.Linear`` layers in the flat parameter vector; ``stacked``
computes their inputs and output gradients for R stacked copies (one per data split; a single run is R = 1);
``gram`` multiplies with the per-example gradient matrix G layer by layer and implements SLANG's exact top-L
update by the Gram trick (eigensolver in ``eigen``); ``low_rank`` holds the Woodbury pieces of the precision
U Uᵀ + diag(d). Laplace: ``pseudo_grads`` (GGN / Fisher factors of linear and conv layers), ``kron`` (KFAC,
EFB, diagonal), ``def_lowrank`` (DEF), ``exact`` (exact blocks) and ``frobenius`` (Lee et al.'s Fig. 5).
"""

from __future__ import annotations

from bdl_bench.curvature.gram import factor_cross, gram_blocks
from bdl_bench.curvature.per_example import LinearLayout, linear_layout

__all__ = ["LinearLayout", "factor_cross", "gram_blocks", "linear_layout"]

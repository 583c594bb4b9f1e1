"""Per-example gradient products without per-example gradient matrices.

``per_example`` computes, for ``nn.Sequential`` networks of ``nn.Linear`` layers, every layer's inputs
and output gradients in one batched forward/backward; ``gram`` multiplies with the per-example
gradient matrix G layer by layer and implements SLANG's exact top-L update by the Gram trick;
``stacked`` computes the layer factors and their sums for R stacked copies (one per data split);
``low_rank`` holds the Woodbury pieces of the precision U Uᵀ + diag(d) (U stored column-major);
``dense`` holds the materialised twins used by the tests.
"""

from __future__ import annotations

from bdl_bench.curvature.gram import (
    LowRankUpdate,
    add_matmul,
    column_sqnorms,
    empty_columns_first,
    factor_cross,
    gram_matrix,
    low_rank_update,
    sq_diag,
)
from bdl_bench.curvature.low_rank import PrecisionCache, build_cache, sample_noise, weighted_gram
from bdl_bench.curvature.per_example import (
    LayerFactors,
    LinearLayout,
    LinearSlot,
    PerExampleFactors,
    linear_factors,
    linear_layout,
)

__all__ = [
    "LayerFactors",
    "LinearLayout",
    "LinearSlot",
    "LowRankUpdate",
    "PerExampleFactors",
    "PrecisionCache",
    "add_matmul",
    "build_cache",
    "column_sqnorms",
    "empty_columns_first",
    "factor_cross",
    "gram_matrix",
    "linear_factors",
    "linear_layout",
    "low_rank_update",
    "sample_noise",
    "sq_diag",
    "weighted_gram",
]

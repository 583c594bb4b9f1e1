"""Per-example gradient products without per-example gradient matrices.

``per_example`` locates the ``nn.Linear`` layers of an ``nn.Sequential`` network in the flat parameter
vector; ``stacked`` computes every layer's inputs and output gradients in one batched forward/backward, and
their sums, for R stacked copies (one per data split; a single run is R = 1); ``gram``
multiplies with the per-example gradient matrix G layer by layer and implements SLANG's exact top-L update
by the Gram trick, with its eigensolver in ``eigen``;
``low_rank`` holds the Woodbury pieces of the precision U Uᵀ + diag(d) (U stored column-major);
``dense`` holds the materialised twins used by the tests.
"""

from __future__ import annotations

from bdl_bench.curvature.gram import (
    LowRankUpdate,
    column_sqnorms,
    combine_rows,
    empty_columns_first,
    factor_cross,
    gram_blocks,
    low_rank_update,
)
from bdl_bench.curvature.low_rank import PrecisionCache, build_cache, sample_noise, weighted_gram
from bdl_bench.curvature.per_example import LinearLayout, LinearSlot, linear_layout

__all__ = [
    "LinearLayout",
    "LinearSlot",
    "LowRankUpdate",
    "PrecisionCache",
    "build_cache",
    "column_sqnorms",
    "combine_rows",
    "empty_columns_first",
    "factor_cross",
    "gram_blocks",
    "linear_layout",
    "low_rank_update",
    "sample_noise",
    "weighted_gram",
]

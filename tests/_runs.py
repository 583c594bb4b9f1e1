"""Comparing the metrics of two runs (importable from any test module: tests/ is on sys.path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bdl_bench.results import COST_METRICS


def without_cost(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` less :data:`~bdl_bench.results.COST_METRICS`: what a repeated or resumed run must reproduce
    exactly."""
    return {k: v for k, v in metrics.items() if k not in COST_METRICS}

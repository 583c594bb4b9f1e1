"""Smoke test of scripts/bench_laplace_fit.py: one JSON line per structure, on a tiny LeNet and 100 images."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_laplace_fit.py"


def test_prints_one_json_line_per_structure_scaled_to_full_size() -> None:
    args = ["--n-data", "100", "--channels", "2,3", "--hidden", "8", "--image-size", "8", "--rank", "4"]
    args += ["--curvature-batch-size", "64", "--device", "cpu"]  # two chunks
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["structure"] for r in records] == ["kfac", "def"]
    for r in records:
        assert r["n_data"] == 100 and r["threads"] == 1 and r["scaled_to"] == 50_000
        assert r["fit_s"] > 0 and r["epoch_s"] > 0
        assert abs(r["epoch_s"] - 500 * r["measured_epoch_s"]) <= 1e-3 * r["epoch_s"] + 1e-2
        assert abs(r["ratio_to_epoch"] - r["fit_s"] / r["epoch_s"]) < 1e-2 * r["ratio_to_epoch"] + 1e-3
        assert "extrapolated from n_data=100 to 50000" in r["scaling"]
        assert r["cpu_fit_s"] > 0 and r["cpu_epoch_s"] > 0
        assert r["device"] == "cpu" and r["cuda_peak_mib"] is None and r["epoch_cuda_peak_mib"] is None
        assert abs(r["cpu_ratio_to_epoch"] - r["cpu_fit_s"] / r["cpu_epoch_s"]) < 1e-2 * r["cpu_ratio_to_epoch"] + 1e-3
    assert records[1]["fit_info"]["kept_rank"] >= 4
    # DEF kept every chunk of pass 1 for its second pass; the cache scales with the data
    assert records[0]["curvature_cache_mib"] is None
    assert records[1]["fit_info"]["cached_chunks"] == records[1]["fit_info"]["curvature_chunks"] == 2
    cache_mib, scaled = records[1]["curvature_cache_mib"], records[1]["curvature_cache_mib_scaled"]
    assert 0 < scaled and abs(scaled - 500 * cache_mib) <= 500 * 0.05 + 0.1  # 500 x, up to rounding to 0.1 MiB
    for r in records:  # DEF's second pass adds multiply-adds to KFAC's
        assert r["fit_macs_per_example"] > 0 and r["flop_ratio"] > 0
    assert records[1]["fit_macs_per_example"] > records[0]["fit_macs_per_example"]


def test_multiply_adds_counts_products_in_place_and_convolutions() -> None:
    """bench_laplace_fit.multiply_adds against hand counts: in-place products, matrix-vector products, and a
    convolution's forward and backward (input and weight gradients)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(SCRIPT.parent))
    import bench_laplace_fit as bench

    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert bench.multiply_adds(lambda: torch.zeros(5, 3).addmm_(a, b)) == 5 * 7 * 3
    assert bench.multiply_adds(lambda: torch.zeros(2, 5, 3).baddbmm_(a.expand(2, 5, 7), b.expand(2, 7, 3))) == 210
    assert bench.multiply_adds(lambda: torch.zeros(5).addmv_(a, torch.randn(7))) == 35
    assert bench.multiply_adds(lambda: torch.mv(a, torch.randn(7))) == 35
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    conv = 2 * 4 * 4 * 4 * 3 * 3 * 3  # N x C_out x 4 x 4 outputs, C_in x 3 x 3 each
    assert bench.multiply_adds(lambda: F.conv2d(x, w)) == conv
    assert bench.multiply_adds(lambda: F.conv2d(x, w).sum().backward()) == 3 * conv

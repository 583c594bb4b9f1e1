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

"""Smoke test of scripts/bench_laplace_predict.py: one JSON line per (structure, predictive), scaled as it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_laplace_predict.py"


def test_prints_one_json_line_per_structure_and_predictive() -> None:
    args = ["--n-data", "60", "--n-predict", "30", "--n-fit", "20", "--n-samples", "3", "--device", "cpu"]
    args += ["--channels", "2,3", "--hidden", "8", "--image-size", "8", "--structures", "diag,kfac"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["structure"], r["predictive"]) for r in records] == [
        ("diag", "sample"),
        ("diag", "linearised"),
        ("kfac", "sample"),
        ("kfac", "linearised"),
    ]
    for r in records:
        assert r["device"] == "cpu" and r["cuda_peak_mib"] is None and r["n_samples"] == 3
        assert abs(r["predict_s"] - 1000 * r["measured_predict_s"]) <= 1e-3 * r["predict_s"] + 1e-2  # 30 -> 30,000
        assert abs(r["epoch_s"] - 50_000 / 60 * r["measured_epoch_s"]) <= 1e-3 * r["epoch_s"] + 1e-2
        assert abs(r["ratio_to_epoch"] - r["predict_s"] / r["epoch_s"]) < 1e-2 * r["ratio_to_epoch"] + 1e-3
        assert r["cpu_ratio_to_epoch"] > 0

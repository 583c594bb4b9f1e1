"""Smoke test of scripts/bench_laplace_predict.py: one JSON line per (structure, predictive), scaled as it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert all(r["flop_ratio"] == records[0]["flop_ratio"] > 0 for r in records)


def test_flop_ratio_of_def_lenet_by_hand() -> None:
    """DEF's LeNet (conv 5x5x32 'same', pool, conv 5x5x64 'same', pool, FC 3136 -> 1024, FC 10): per image the forward
    pass has 28²·32·25 + 14²·64·32·25 + 3136·1024 + 1024·10 multiply-adds, a training step three times that less the
    first convolution's input gradient; 10 samples over 30,000 images against an epoch of 50,000 is about 2.03."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import bench_laplace_predict as bench

    from bdl_bench.models import build_model

    torch.manual_seed(0)
    cfg = {"name": "lenet", "image_size": 28, "channels": [32, 64], "hidden": 1024, "dropout": 0.0}
    model = build_model(cfg, in_features=1, out_features=10)
    x, y = torch.rand(50, 1, 28, 28), torch.randint(0, 10, (50,))
    conv1 = 28 * 28 * 32 * 25
    forward = conv1 + 14 * 14 * 64 * 32 * 25 + 3136 * 1024 + 1024 * 10
    step = 3 * forward - conv1
    expected = 10 * 30_000 * forward / (50_000 * step)
    assert bench.flop_ratio(model, x, y, 10) == pytest.approx(expected, rel=1e-12)
    assert 2.0 < expected < 2.1

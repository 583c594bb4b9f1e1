"""The benchmark scripts refuse ``--device cuda`` on a machine without CUDA with one line (no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("script", ["bench_step.py", "bench_laplace_fit.py", "bench_laplace_predict.py"])
def test_device_cuda_without_a_gpu_is_one_line(script: str) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--device", "cuda"], capture_output=True, text=True, timeout=120
    )
    expected = 2 if script == "bench_step.py" else 1  # argparse's parser.error exits with 2
    assert out.returncode == expected, out.stderr
    assert "Traceback" not in out.stderr
    assert "--device cuda" in out.stderr and "no CUDA device is available" in out.stderr

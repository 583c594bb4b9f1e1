"""trainer.threads limits PyTorch and the BLAS under SciPy's LAPACK calls (SLANG's eigensolver) alike."""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_info, threadpool_limits

import bdl_bench.curvature.gram  # noqa: F401  (loads SciPy's LAPACK, as every run does)
from bdl_bench.orchestration.threads import set_threads


def test_set_threads_limits_torch_and_the_loaded_blas() -> None:
    torch_before = torch.get_num_threads()
    blas_before = [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]
    assert blas_before, "SciPy's BLAS is loaded"
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        assert all(info["num_threads"] == 1 for info in threadpool_info() if info["user_api"] == "blas")
    finally:
        torch.set_num_threads(torch_before)
        threadpool_limits(limits=max(blas_before), user_api="blas")

"""``scripts/bench_step.py``'s floors count every matrix-product multiply-add that the steps perform.

The multiply-adds are counted by intercepting the matrix-product operators of one real step (SLANG, GMFVI,
plain SGD) on small MLPs (``bench_laplace_fit.multiply_adds``: in-place and matrix-vector products included);
``flop_ratio`` and ``vi_flop_ratio`` must equal their ratio.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_laplace_fit  # noqa: E402  (multiply_adds: the benchmarks' own count)
import bench_step  # noqa: E402


def _count(step: Callable[[], None]) -> int:
    step()  # a first step (U = 0) and a warm one
    step()
    return bench_laplace_fit.multiply_adds(step)


@pytest.fixture()
def small_mlp(monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """bench_step's model, shrunk to 30-20-20-4 (same structure: three linear layers, ReLU)."""
    from bdl_bench.models.mlp import mlp

    def build(device: torch.device, batch: int, seed: int, hidden: object = None):  # noqa: ANN202
        torch.manual_seed(seed)
        model = mlp(in_features=30, out_features=4, hidden=[20, 20], activation="relu").to(device)
        return model, torch.randn(batch, 30, device=device), torch.randint(0, 4, (batch,), device=device)

    monkeypatch.setattr(bench_step, "_build", build)
    return build(torch.device("cpu"), 1, 0)[0]


@pytest.mark.parametrize(("rank", "n_samples"), [(3, 1), (5, 2)])
def test_slang_flop_ratio_counts_every_matrix_product(small_mlp: torch.nn.Module, rank: int, n_samples: int) -> None:
    cpu, batch = torch.device("cpu"), 16
    slang = _count(bench_step._slang_stepper(cpu, batch, rank, n_samples))
    sgd = _count(bench_step._sgd_stepper(cpu, batch))
    assert bench_step.flop_ratio(small_mlp, batch, rank, n_samples) == pytest.approx(slang / sgd, rel=1e-9)


def test_gmfvi_flop_ratio_counts_every_matrix_product(small_mlp: torch.nn.Module) -> None:
    cpu, batch = torch.device("cpu"), 16
    cfg = bench_step.vi_config("gmfvi", 1)
    gmfvi = _count(bench_step._vi_stepper(cpu, batch, cfg))
    sgd = _count(bench_step._sgd_stepper(cpu, batch))
    assert bench_step.vi_flop_ratio(small_mlp, batch, cfg, 1) == pytest.approx(gmfvi / sgd, rel=1e-9)


def test_ivon_flop_ratio_counts_every_matrix_product(small_mlp: torch.nn.Module) -> None:
    """IVON's step is one forward and backward per sample at a sampled weight vector, the gradient taken with
    respect to the weights alone: SGD's products, once per sample."""
    cpu, batch = torch.device("cpu"), 16
    cfg = bench_step.vi_config("ivon", 1)
    ivon = _count(bench_step._vi_stepper(cpu, batch, cfg))
    sgd = _count(bench_step._sgd_stepper(cpu, batch))
    assert bench_step.vi_flop_ratio(small_mlp, batch, cfg, 1) == pytest.approx(ivon / sgd, rel=1e-9)

"""DEF toy figure and Frobenius study: invariants of Fig. 5's errors, and both studies end to end (tiny)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from bdl_bench.likelihoods import Gaussian
from bdl_bench.studies import def_frobenius, def_toy


@pytest.fixture
def tiny_layer_table() -> pd.DataFrame:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    theta = torch.randn(16, generator=g, dtype=torch.float64)
    x = torch.randn(40, 1, generator=g, dtype=torch.float64)
    table, eigenvalues = def_frobenius.layer_approximations(model, theta, x, torch.zeros(40), Gaussian(2.0))
    assert eigenvalues.shape == (10,)
    return table


def test_frobenius_errors_follow_lemmas_1_and_4(tiny_layer_table: pd.DataFrame) -> None:
    t = tiny_layer_table.set_index(["method", "rank"], drop=False)
    defs = tiny_layer_table[tiny_layer_table["method"] == "DEF"]
    assert (defs["err_diag"] < 1e-12).all()  # Prop. 1: DEF's diagonal is exact at every rank
    row = lambda m: tiny_layer_table[tiny_layer_table["method"] == m].iloc[0]  # noqa: E731
    assert row("Diag")["err_diag"] == 0 and row("Diag")["err_offdiag"] == pytest.approx(1.0)
    full = defs.iloc[-1]
    assert full["kept"] == 10
    assert full["err_total"] <= row("EFB")["err_total"] + 1e-12  # Lemma 1
    assert row("EFB")["err_total"] <= row("KFAC")["err_total"] + 1e-12  # George et al. (2018)
    assert full["err_offdiag"] == pytest.approx(row("EFB")["err_offdiag"])  # same off-diagonal as EFB
    assert len(t) == 3 + 10


def test_frobenius_study_writes_its_figure(tmp_path: Path) -> None:
    png, csv = def_frobenius.run_study(tmp_path, ["data.n_train=20", "trainer.n_epochs=20"])
    assert png.stat().st_size > 0
    assert set(pd.read_csv(csv)["method"]) == {"Diag", "KFAC", "EFB", "DEF"}


def test_toy_study_writes_its_figure(tmp_path: Path) -> None:
    png, csv = def_toy.run_study(tmp_path, ["map", "def", "block"], ["trainer.n_epochs=30"])
    table = pd.read_csv(csv)
    assert png.stat().st_size > 0
    assert list(table["variant"]) == ["map", "def", "block"]
    assert table["rmse"].notna().all()

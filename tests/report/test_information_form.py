"""DEF Fig. 1 (figure kind ``information_form``): the spectrum's counts and where N and tau come from. The figure
itself is drawn from a real MAP run in tests/test_reproduce.py (the def_frobenius quick reproduction)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from bdl_bench.errors import ResultsError
from bdl_bench.report.information_form import _chosen_scales, spectrum_summary


def test_spectrum_summary_counts_near_zero_eigenvalues_and_the_few_that_hold_the_trace() -> None:
    # trace 200: 100 + 90 = 190 (95 %), + 8 = 198 (99 %): three hold 99 %; 0.5, 0.5, 1e-3 and 0 are below 1 %
    values = torch.tensor([0.5, 100.0, 8.0, 0.5, 90.0, 1e-3, 0.0, -1e-12], dtype=torch.float64)
    summary = spectrum_summary(values)
    assert summary["n_params"] == 8 and summary["n_trace"] == 3 and summary["n_small"] == 5
    assert summary["frac_small"] == pytest.approx(5 / 8) and summary["frac_trace"] == pytest.approx(3 / 8)
    assert spectrum_summary(torch.ones(4))["n_trace"] == 4  # a flat spectrum is not sparse


def _run(folder: Path, method: dict, metrics: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "prior_precision": 0.5}))
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_n_and_tau_are_the_laplace_columns_choice_else_its_fixed_values(tmp_path: Path) -> None:
    _run(tmp_path / "nn", {"name": "map"}, {"accuracy": 0.99})
    _run(
        tmp_path / "def",
        {"name": "laplace", "structure": "def"},
        {"chosen_dataset_scale": 1e5, "chosen_prior_precision": 110.0},
    )
    _run(
        tmp_path / "kfac",
        {"name": "laplace", "structure": "kfac", "dataset_scale": 50.0, "prior_precision": None},
        {"accuracy": 0.9},
    )
    assert _chosen_scales(tmp_path, "def") == (1e5, 110.0)
    assert _chosen_scales(tmp_path, "kfac") == (50.0, 0.5)  # no search: its own N, the experiment's prior
    with pytest.raises(ResultsError, match="no finished Laplace run with structure diag"):
        _chosen_scales(tmp_path, "diag")

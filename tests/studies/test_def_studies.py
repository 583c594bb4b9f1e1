"""DEF toy figure study end to end (tiny); Fig. 5's errors are tested in tests/curvature/test_frobenius.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bdl_bench.studies import def_toy


def test_toy_study_writes_its_figure(tmp_path: Path) -> None:
    png, csv = def_toy.run_study(tmp_path, ["map", "def", "block"], ["trainer.n_epochs=30"])
    table = pd.read_csv(csv)
    assert png.stat().st_size > 0
    assert list(table["variant"]) == ["map", "def", "block"]
    assert table["rmse"].notna().all()

"""DEF Fig. 10 (figure kind ``laplace_search``) from the Laplace runs' laplace_search.csv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bdl_bench.errors import ResultsError
from bdl_bench.methods.laplace.search import write_search_table
from bdl_bench.report.figures import draw_figures


def _laplace_run(folder: Path, structure: str, taus: list[float], chosen: float) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": {"name": "laplace", "structure": structure}}))
    rows = [
        {
            "dataset_scale": scale,
            "prior_precision": tau,
            "status": "evaluated",
            "val_accuracy": 0.99 - 0.1 / tau,
            "val_ece": abs(tau - chosen) / 1e4 + 0.01,
            "chosen": scale == 50000 and tau == chosen,
        }
        for scale in (1, 50000)
        for tau in taus
    ]
    rows.append({"dataset_scale": 50000, "prior_precision": 1e-2, "status": "pruned"})
    write_search_table(rows, folder / "laplace_search.csv")
    metrics = {
        "chosen_dataset_scale": 50000.0,
        "chosen_prior_precision": chosen,
        "search_val_accuracy": 0.99 - 0.1 / chosen,
        "search_val_ece": 0.01,
        "search_map_val_accuracy": 0.99,
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_fig10_draws_each_structures_grid_and_tables_its_choice(tmp_path: Path) -> None:
    _laplace_run(tmp_path / "variant=def_table1" / "diag", "diag", [1.0, 100.0, 1e4], chosen=100.0)
    _laplace_run(tmp_path / "variant=def_table1" / "kfac", "kfac", [10.0, 1e3], chosen=1e3)
    spec = {"name": "fig10_laplace_search", "kind": "laplace_search", "structures": ["diag", "kfac"]}
    drawn, skipped = draw_figures([spec], tmp_path)
    assert skipped == []
    assert drawn[0].png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = drawn[0].table
    assert list(table["structure"]) == ["diag", "kfac"]
    assert list(table["n_evaluated"]) == [6, 4]  # both N of the grid; the pruned point is not drawn
    assert list(table["chosen_prior_precision"]) == [100.0, 1000.0]
    assert "| diag | 6 | 5e+04 | 100 | 0.989 | 0.01 | 0.99 |" in drawn[0].table_markdown


def test_fig10_names_the_structure_without_a_search(tmp_path: Path) -> None:
    _laplace_run(tmp_path / "diag", "diag", [1.0, 10.0], chosen=10.0)
    drawn, skipped = draw_figures(
        [{"name": "fig10", "kind": "laplace_search", "structures": ["diag", "kfac"]}], tmp_path
    )
    assert drawn == [] and len(skipped) == 1 and "for kfac" in skipped[0]
    with pytest.raises(ResultsError, match="for kfac"):
        from bdl_bench.report.def_search import search_grids

        search_grids(tmp_path, ["kfac"])

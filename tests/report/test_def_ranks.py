"""DEF Table 2 from the DEF runs' def_ranks.csv, beside the paper's N and L per layer."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from bdl_bench.errors import ResultsError
from bdl_bench.report.def_ranks import def_ranks_table, layer_names
from bdl_bench.report.figures import draw_figures


def test_layers_are_named_as_the_paper_names_them() -> None:
    assert layer_names(["conv", "conv", "linear", "linear"]) == ["CNN-1", "CNN-2", "FC-1", "FC-2"]


def test_table_puts_the_paper_beside_each_layer(tmp_path: Path) -> None:
    run = tmp_path / "variant=def_table1" / "def"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"method": {"name": "laplace", "rank": 200}}))
    pd.DataFrame(
        {
            "module_index": [0, 3, 7, 9],
            "kind": ["conv", "conv", "linear", "linear"],
            "m": [32, 64, 1024, 10],
            "n": [26, 801, 3137, 1025],
            "n_weights": [800, 51200, 3211264, 10240],
            "n_block": [832, 51264, 3212288, 10250],
            "g": [20, 30, 40, 10],
            "a": [20, 30, 10, 100],
            "kept_rank": [400, 900, 400, 1000],
        }
    ).to_csv(run / "def_ranks.csv", index=False)
    table, text = def_ranks_table(tmp_path)
    assert list(table["layer"]) == ["CNN-1", "CNN-2", "FC-1", "FC-2"]
    assert list(table["paper_l"]) == [450, 5185, 5625, 4775] and list(table["paper_n"]) == [800, 51200, 3211264, 10240]
    assert table["percent"].iloc[0] == pytest.approx(50.0)
    assert "| CNN-1 | 200 | 800 | 32 x 26 | 20 x 20 | 400 | 50.00 | 800 | 450 | 56.25 |" in text
    drawn, skipped = draw_figures([{"name": "table2_def_ranks", "kind": "def_ranks"}], tmp_path)
    assert skipped == [] and drawn[0].png is None and not drawn[0].is_table  # printed after the runs' table
    with pytest.raises(ResultsError, match="def_ranks.csv"):
        def_ranks_table(tmp_path / "variant=def_table1" / "nothing_here")

"""Run-folder files: the history CSV stays valid as rows and columns arrive."""

from __future__ import annotations

import csv
from pathlib import Path

from bdl_bench.results import HistoryWriter


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_history_appends_and_widens(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    writer = HistoryWriter(path)
    writer.append({"epoch": 1, "train/loss": 0.5})
    writer.append({"epoch": 2, "train/loss": 0.4})
    assert _read(path) == [{"epoch": "1", "train/loss": "0.5"}, {"epoch": "2", "train/loss": "0.4"}]
    writer.append({"epoch": 3, "train/loss": 0.3, "test/nll": 0.9})  # a new column: header widens
    rows = _read(path)
    assert list(rows[0]) == ["epoch", "train/loss", "test/nll"]
    assert rows[0]["test/nll"] == "" and rows[2]["test/nll"] == "0.9"
    writer.append({"epoch": 4, "train/loss": 0.2})
    assert [r["epoch"] for r in _read(path)] == ["1", "2", "3", "4"]


def test_history_resumed_rows_are_rewritten_first(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    path.write_text("stale\n")
    writer = HistoryWriter(path, rows=[{"epoch": 1, "train/loss": 0.5}])
    writer.append({"epoch": 2, "train/loss": 0.4})
    assert [r["epoch"] for r in _read(path)] == ["1", "2"]

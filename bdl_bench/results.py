"""Run folders: atomic writes while a run is alive, and loading finished runs into a DataFrame.

A run folder holds ``config.yaml`` (the resolved config), ``history.csv`` (one row per epoch,
appended as training goes) and ``metrics.json``, written last and atomically: its presence means the
run finished. Loading never needs the run to have happened on this machine.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.csv"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_metrics(run_dir: Path, metrics: Mapping[str, Any]) -> None:
    atomic_write_text(run_dir / METRICS_FILE, json.dumps({k: _json_safe(v) for k, v in metrics.items()}, indent=2))


def write_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False))


class HistoryWriter:
    """Appends one CSV row per epoch; columns are fixed by the first row and grow if needed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def append(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        columns: list[str] = []
        for r in self.rows:
            columns += [k for k in r if k not in columns]
        # Rewritten whole each epoch (histories are small) so that a new column keeps a valid file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"method": {"rank": 1}}`` → ``{"method.rank": 1}``; lists become strings."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = str(list(value))
        else:
            out[name] = value
    return out


def find_run_dirs(root: Path) -> Iterable[Path]:
    """Every folder below ``root`` (or ``root`` itself) holding a ``config.yaml``."""
    return sorted(p.parent for p in Path(root).rglob(CONFIG_FILE))


def load_runs(root: Path, *, include_unfinished: bool = False) -> pd.DataFrame:
    """One row per run below ``root``: flattened config keys plus metrics and ``run_dir``.

    Unfinished runs (no ``metrics.json``) are left out unless ``include_unfinished``; the
    ``finished`` column says which is which.
    """
    rows = []
    for run_dir in find_run_dirs(Path(root)):
        metrics_path = run_dir / METRICS_FILE
        finished = metrics_path.exists()
        if not finished and not include_unfinished:
            continue
        config = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
        row = flatten(config)
        if finished:
            row.update(json.loads(metrics_path.read_text()))
        row["run_dir"] = str(run_dir)
        row["finished"] = finished
        rows.append(row)
    return pd.DataFrame(rows)

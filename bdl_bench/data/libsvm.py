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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse

from bdl_bench.data.base import DataFileError, Dataset, DatasetLoader, Task, as_float, register_dataset
from bdl_bench.data.checksums import data_file
from bdl_bench.data.splits import SplitIndices, carve_validation, check_seed, check_split, random_halves
from bdl_bench.errors import ConfigError

RawArrays = tuple[np.ndarray, np.ndarray, int | None]
"""``(x, y01, n_fixed_train)``: inputs, {0,1} labels, and the size of a fixed training part (or None)."""


@dataclass(frozen=True)
class _Source:
    file: str
    read: Callable[[Path], RawArrays]


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


def _read_pm1(path: Path) -> RawArrays:
    mat = scipy.io.loadmat(path)
    return _dense(mat["X"]), _recode(mat["y"], -1, 1, path), None


def _read_breast_cancer(path: Path) -> RawArrays:
    mat = scipy.io.loadmat(path)
    return _dense(mat["X"]), _recode(mat["y"], 2, 4, path), None


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


LIBSVM_SOURCES: dict[str, _Source] = {
    "a1a": _Source("libsvm/a1a.mat", _read_a1a),
    "australian": _Source("libsvm/australian_scale.mat", _read_pm1),
    "breast_cancer": _Source("libsvm/breast_cancer_scale.mat", _read_breast_cancer),
    "usps_3vs5": _Source("libsvm/usps_3vs5.npz", _read_npz),
}
"""Short name (after ``libsvm/``) -> file under ``data/`` and its reader."""


@cache
def _read_cached(name: str, path: str, size: int, mtime_ns: int) -> RawArrays:
    x, y, n_fixed = LIBSVM_SOURCES[name].read(Path(path))
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y, n_fixed


def _source(name: str) -> _Source:
    if name not in LIBSVM_SOURCES:
        raise ConfigError(f"unknown LIBSVM dataset {name!r}; available: {', '.join(LIBSVM_SOURCES)}")
    return LIBSVM_SOURCES[name]


def load_libsvm_raw(name: str, root: str | Path | None = None) -> RawArrays:
    """All rows of a LIBSVM set: dense float64 inputs, labels in {0., 1.}, fixed-train size.

    Args:
        name: Short name, e.g. ``"a1a"``.
        root: Data root (default: the shipped ``data/``).

    Returns:
        ``(x, y, n_fixed_train)``, read-only arrays. For ``a1a`` the rows are a1a (padded to 123 columns)
        followed by a1a.t and ``n_fixed_train`` is 1605; for the others it is ``None``.
    """
    path = data_file(_source(name).file, root)
    stat = path.stat()
    return _read_cached(name, str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def libsvm_split_indices(
    name: str, *, split: int, val_fraction: float = 0.0, seed: int = 0, root: str | Path | None = None
) -> SplitIndices:
    """Row ids (into :func:`load_libsvm_raw`) of split ``split``.

    Args:
        name: Short name, e.g. ``"australian"``.
        split: For ``a1a`` must be 0 (the fixed split); otherwise any non-negative integer, used as the seed
            of the random 50/50 permutation.
        val_fraction: Fraction of the training rows moved to validation, in ``[0, 1)``.
        seed: Seed of the permutation that picks the validation rows.
        root: Data root (default: the shipped ``data/``).

    Returns:
        Disjoint train / val / test row ids.

    Raises:
        ValueError: On an unknown name, a bad split or a bad ``val_fraction``.
    """
    dataset = f"libsvm/{name}"
    _source(name)
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
    """Load LIBSVM set ``name`` as a binary task (no feature standardisation).

    Args:
        name: Short name, one of :data:`LIBSVM_SOURCES`.
        split: ``a1a``: must be 0. Others: seed of the random 50/50 train/test permutation.
        val_fraction: Fraction of the training rows carved out as a validation part (0: none).
        seed: Seed of the permutation choosing the validation rows.
        add_bias: Prepend a column of ones to the inputs.
        root: Data root (default: the shipped ``data/``); files are checked against ``data/SHA256SUMS``.

    Returns:
        A :class:`Dataset` with ``Task.BINARY``, float32 inputs and float32 targets in {0, 1}.

    Raises:
        ValueError: On a bad split or ``val_fraction``.
        DataFileError: If a data file is missing or corrupted.
    """
    x, y, _ = load_libsvm_raw(name, root)
    idx = libsvm_split_indices(name, split=split, val_fraction=val_fraction, seed=seed, root=root)

    def inputs(rows: np.ndarray) -> np.ndarray:
        part = x[rows]
        return np.hstack([np.ones((part.shape[0], 1)), part]) if add_bias else part

    return Dataset(
        name=f"libsvm/{name}",
        task=Task.BINARY,
        x_train=as_float(inputs(idx.train)),
        y_train=as_float(y[idx.train]),
        x_val=as_float(inputs(idx.val)),
        y_val=as_float(y[idx.val]),
        x_test=as_float(inputs(idx.test)),
        y_test=as_float(y[idx.test]),
    )


def _make_loader(name: str) -> DatasetLoader:
    def load(
        *,
        split: int = 0,
        val_fraction: float = 0.0,
        seed: int = 0,
        add_bias: bool = False,
        root: str | Path | None = None,
    ) -> Dataset:
        return load_libsvm(name, split=split, val_fraction=val_fraction, seed=seed, add_bias=add_bias, root=root)

    load.__name__ = load.__qualname__ = f"load_libsvm_{name}"
    load.__doc__ = f"Load ``libsvm/{name}`` (``data/{LIBSVM_SOURCES[name].file}``); see :func:`load_libsvm`."
    return register_dataset(f"libsvm/{name}")(load)


LOADERS: dict[str, DatasetLoader] = {name: _make_loader(name) for name in LIBSVM_SOURCES}
"""The registered ``libsvm/<name>`` loaders, keyed by short name."""

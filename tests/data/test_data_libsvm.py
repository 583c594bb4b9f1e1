"""LIBSVM loaders: shapes, label coding, random halves, a1a's fixed split, bias column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bdl_bench.data import build_dataset
from bdl_bench.data.base import Task
from bdl_bench.data.libsvm import libsvm_split_indices, load_libsvm, load_libsvm_raw


def test_a1a_fixed_split() -> None:
    ds = load_libsvm("a1a", split=0)
    assert ds.task is Task.BINARY
    assert ds.x_train.shape == (1605, 123) and ds.x_test.shape == (30956, 123)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.float32
    assert bool((ds.x_train[:, 119:] == 0).all())  # padded columns
    assert bool((ds.x_test[:, 119:] != 0).any())
    assert set(ds.y_train.unique().tolist()) == {0.0, 1.0}
    assert int(ds.y_train.sum()) == 395 and int(ds.y_test.sum()) == 7446


@pytest.mark.parametrize("bad", [1, -1, 19])
def test_a1a_only_split_0(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"libsvm/a1a: split={bad}"):
        load_libsvm("a1a", split=bad)


def test_australian_random_halves() -> None:
    ds = build_dataset({"name": "libsvm/australian", "split": 0, "protocol": {"prior_precision": 1e-5}})
    assert ds.x_train.shape == (345, 14) and ds.x_test.shape == (345, 14)
    assert ds.n_train + ds.x_test.shape[0] == 690
    assert set(ds.y_train.unique().tolist()) | set(ds.y_test.unique().tolist()) == {0.0, 1.0}
    assert int(ds.y_train.sum() + ds.y_test.sum()) == 307
    assert float(ds.x_train.abs().max()) <= 1.0  # no standardisation: scaled features stay in [-1, 1]


def test_breast_cancer_labels() -> None:
    ds = load_libsvm("breast_cancer", split=4)
    assert ds.x_train.shape == (341, 10) and ds.x_test.shape == (342, 10)
    labels = torch.cat([ds.y_train, ds.y_test])
    assert set(labels.unique().tolist()) == {0.0, 1.0}
    assert int(labels.sum()) == 239  # malignant (label 4)


def test_usps_3vs5() -> None:
    x, y, n_fixed = load_libsvm_raw("usps_3vs5")
    assert x.shape == (1540, 256) and n_fixed is None
    assert int(y.sum()) == 716 and x.min() == -1.0 and x.max() == 1.0
    ds = load_libsvm("usps_3vs5", split=1)
    assert ds.x_train.shape == (770, 256) and ds.x_test.shape == (770, 256)


def test_split_is_permutation_seed() -> None:
    idx = libsvm_split_indices("australian", split=3)
    expected = torch.randperm(690, generator=torch.Generator().manual_seed(3)).numpy()
    np.testing.assert_array_equal(idx.train, expected[:345])
    np.testing.assert_array_equal(idx.test, expected[345:])
    assert not set(idx.train.tolist()) & set(idx.test.tolist())
    other = libsvm_split_indices("australian", split=4)
    assert not np.array_equal(other.train, idx.train)
    a, b = load_libsvm("australian", split=3), load_libsvm("australian", split=3)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)


def test_rows_match_indices_and_val() -> None:
    x, y, _ = load_libsvm_raw("breast_cancer")
    idx = libsvm_split_indices("breast_cancer", split=2, val_fraction=0.25, seed=5)
    ds = load_libsvm("breast_cancer", split=2, val_fraction=0.25, seed=5)
    assert len(idx.val) == round(0.25 * 341) and len(idx.train) == 341 - len(idx.val)
    for part, rows in (("train", idx.train), ("val", idx.val), ("test", idx.test)):
        np.testing.assert_allclose(getattr(ds, f"x_{part}").numpy(), x[rows], rtol=1e-6)
        np.testing.assert_array_equal(getattr(ds, f"y_{part}").numpy(), y[rows])
    all_rows = np.concatenate([idx.train, idx.val, idx.test])
    assert len(set(all_rows.tolist())) == len(all_rows) == 683


def test_add_bias() -> None:
    ds = load_libsvm("australian", split=0, add_bias=True, val_fraction=0.1)
    plain = load_libsvm("australian", split=0, val_fraction=0.1)
    for part in ("train", "val", "test"):
        x = getattr(ds, f"x_{part}")
        assert x.shape[1] == 15 and bool((x[:, 0] == 1).all())
        assert torch.equal(x[:, 1:], getattr(plain, f"x_{part}"))


def test_negative_split_rejected() -> None:
    with pytest.raises(ValueError, match=r"split=-2"):
        load_libsvm("australian", split=-2)

"""toy/cubic: sizes, ranges, determinism, standardisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bdl_bench.data import build_dataset
from bdl_bench.data.base import Task
from bdl_bench.data.toy import load_cubic, make_cubic


def test_cubic_raw() -> None:
    x_tr, y_tr, x_te, y_te = make_cubic(seed=0)
    assert x_tr.shape == (20, 1) and y_tr.shape == (20,)
    assert x_te.shape == (200, 1) and y_te.shape == (200,)
    assert float(x_tr.min()) >= -4 and float(x_tr.max()) <= 4
    assert x_te[0, 0] == -6 and x_te[-1, 0] == 6
    resid = np.concatenate([y_tr - x_tr[:, 0] ** 3, y_te - x_te[:, 0] ** 3])
    assert 2.0 < resid.std() < 4.0  # noise std 3


def test_cubic_dataset() -> None:
    ds = build_dataset({"name": "toy/cubic", "seed": 0, "protocol": {"n_splits": 1}})
    assert ds.task is Task.REGRESSION and ds.n_train == 20 and ds.x_test.shape == (200, 1)
    assert abs(float(ds.x_train.double().mean())) < 1e-5 and abs(float(ds.y_train.double().mean())) < 1e-5
    x_tr, y_tr, _, y_te = make_cubic(seed=0)
    np.testing.assert_allclose(ds.y_train.double().numpy() * ds.y_std + ds.y_mean, y_tr, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ds.y_test.double().numpy() * ds.y_std + ds.y_mean, y_te, rtol=1e-5, atol=1e-3)
    # test grid extends beyond the training inputs (in standardised units too)
    assert float(ds.x_test.min()) < float(ds.x_train.min()) and float(ds.x_test.max()) > float(ds.x_train.max())


def test_cubic_determinism_and_val() -> None:
    a, b, c = load_cubic(seed=1), load_cubic(seed=1), load_cubic(seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    v = load_cubic(seed=1, val_fraction=0.25)
    assert v.n_train == 15 and v.x_val.shape == (5, 1)


def test_cubic_split_must_be_zero() -> None:
    with pytest.raises(ValueError, match=r"toy/cubic: split=1"):
        load_cubic(split=1)


def test_unstandardised_cubic_is_in_original_units() -> None:
    """``standardise: false`` (the SLANG authors' App. F.1 toy): the draws of make_cubic as they are."""
    x_tr, y_tr, x_te, y_te = make_cubic(n_train=30, n_test=50, test_bound=8.0, seed=1)
    raw = load_cubic(n_train=30, n_test=50, test_bound=8.0, seed=1, standardise=False)
    assert (raw.y_mean, raw.y_std) == (0.0, 1.0)
    np.testing.assert_allclose(raw.x_train.numpy(), x_tr, rtol=1e-6)
    np.testing.assert_allclose(raw.y_test.numpy(), y_te, rtol=1e-6, atol=1e-5)
    default = load_cubic(n_train=30, n_test=50, test_bound=8.0, seed=1)
    assert default.y_std == pytest.approx(float(np.std(y_tr))) and abs(float(default.x_train.mean())) < 1e-6

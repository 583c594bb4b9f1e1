"""UCI loaders: shapes, standardisation, split bookkeeping, validation carving, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bdl_bench.data import build_dataset
from bdl_bench.data.base import Task
from bdl_bench.data.uci import UCI_N_SPLITS, load_uci, load_uci_raw, uci_split_indices

# split 0 sizes from Gal's index files: (n_train, n_test, n_features)
SPLIT0 = {
    "boston": (455, 51, 13),
    "concrete": (927, 103, 8),
    "energy": (691, 77, 8),
    "kin8nm": (7373, 819, 8),
    "naval": (10741, 1193, 16),
    "power": (8611, 957, 4),
    "protein": (41157, 4573, 9),
    "wine": (1439, 160, 11),
    "yacht": (277, 31, 6),
}


@pytest.mark.parametrize("name", sorted(SPLIT0))
def test_split0_shapes_and_standardisation(name: str) -> None:
    n_train, n_test, n_features = SPLIT0[name]
    ds = build_dataset({"name": f"uci/{name}", "split": 0, "val_fraction": 0.0, "seed": 0, "root": None})
    assert ds.name == f"uci/{name}" and ds.task is Task.REGRESSION
    assert ds.x_train.shape == (n_train, n_features) and ds.y_train.shape == (n_train,)
    assert ds.x_test.shape == (n_test, n_features) and ds.y_test.shape == (n_test,)
    assert ds.x_val.shape == (0, n_features) and ds.y_val.shape == (0,)
    for t in (ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.x_val):
        assert t.dtype == torch.float32 and bool(torch.isfinite(t).all())

    x64 = ds.x_train.double()
    assert torch.allclose(x64.mean(0), torch.zeros(n_features, dtype=torch.float64), atol=1e-4)
    std = x64.std(0, unbiased=False)
    constant = std < 1e-6  # naval has constant input columns: they standardise to exactly 0
    assert bool((ds.x_train[:, constant] == 0).all())
    assert torch.allclose(std[~constant], torch.ones(int((~constant).sum()), dtype=torch.float64), atol=1e-4)
    assert abs(ds.y_train.double().mean().item()) < 1e-4
    assert abs(ds.y_train.double().std(unbiased=False).item() - 1) < 1e-4

    # y_mean / y_std map the standardised targets back to the original rows
    _, y = load_uci_raw(name)
    idx = uci_split_indices(name, split=0)
    scale = max(1.0, float(np.abs(y).max()))
    for part, rows in (("train", idx.train), ("test", idx.test)):
        back = getattr(ds, f"y_{part}").double().numpy() * ds.y_std + ds.y_mean
        np.testing.assert_allclose(back, y[rows], atol=1e-5 * scale)
    np.testing.assert_allclose(ds.y_mean, y[idx.train].mean(), rtol=1e-12)


def test_naval_constant_columns_are_zero() -> None:
    ds = load_uci("naval", split=0)
    std = ds.x_train.std(0, unbiased=False)
    assert int((std == 0).sum()) == 2  # inputs 8 and 11 are constant
    assert bool((ds.x_test[:, std == 0] == 0).all())


def test_indices_disjoint_and_cover_all_rows() -> None:
    x, _ = load_uci_raw("boston")
    idx = uci_split_indices("boston", split=3, val_fraction=0.2, seed=1)
    parts = [set(idx.train.tolist()), set(idx.val.tolist()), set(idx.test.tolist())]
    assert not parts[0] & parts[1] and not parts[0] & parts[2] and not parts[1] & parts[2]
    assert set().union(*parts) == set(range(x.shape[0]))


def test_rows_match_indices() -> None:
    """The loaded (standardised) train rows are the raw rows named by the indices (boston has no duplicates)."""
    x, _ = load_uci_raw("boston")
    idx = uci_split_indices("boston", split=5, val_fraction=0.1, seed=2)
    ds = load_uci("boston", split=5, val_fraction=0.1, seed=2)
    mean, std = x[idx.train].mean(0), x[idx.train].std(0)
    for part, rows in (("train", idx.train), ("val", idx.val), ("test", idx.test)):
        np.testing.assert_allclose(
            getattr(ds, f"x_{part}").double().numpy() * std + mean, x[rows], rtol=1e-5, atol=1e-4
        )
    assert len({tuple(r) for r in x[idx.train]} & {tuple(r) for r in x[idx.test]}) == 0


def test_val_carving() -> None:
    full = uci_split_indices("yacht", split=0)
    idx = uci_split_indices("yacht", split=0, val_fraction=0.1, seed=7)
    assert len(idx.val) == round(0.1 * 277) and len(idx.train) == 277 - len(idx.val)
    assert sorted(np.concatenate([idx.train, idx.val]).tolist()) == sorted(full.train.tolist())
    np.testing.assert_array_equal(idx.test, full.test)
    ds = load_uci("yacht", split=0, val_fraction=0.1, seed=7)
    assert ds.x_val.shape == (28, 6) and ds.x_train.shape == (249, 6)
    # statistics come from the remaining training part only
    assert torch.allclose(ds.x_train.double().mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-4)
    # deterministic in seed, different for another seed
    np.testing.assert_array_equal(uci_split_indices("yacht", split=0, val_fraction=0.1, seed=7).val, idx.val)
    assert not np.array_equal(uci_split_indices("yacht", split=0, val_fraction=0.1, seed=8).val, idx.val)


def test_determinism_and_different_splits() -> None:
    a, b = load_uci("energy", split=2), load_uci("energy", split=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    c = load_uci("energy", split=3)
    assert not np.array_equal(uci_split_indices("energy", split=2).test, uci_split_indices("energy", split=3).test)
    assert not torch.equal(a.y_test, c.y_test)


@pytest.mark.parametrize(("name", "bad"), [("boston", 20), ("boston", -1), ("protein", 5), ("yacht", 1.5)])
def test_split_out_of_range(name: str, bad: object) -> None:
    n = UCI_N_SPLITS[name]
    with pytest.raises(ValueError, match=rf"split={bad!r}.*0\.\.{n - 1}") as err:
        load_uci(name, split=bad)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2])
def test_bad_val_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"val_fraction={bad!r}"):
        load_uci("yacht", split=0, val_fraction=bad)

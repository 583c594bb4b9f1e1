"""The reference posterior of a split (sym_kl): fitted once, cached, independent of the asking method."""

from __future__ import annotations

from pathlib import Path

import torch

from bdl_bench.data.base import Dataset, Task
from bdl_bench.gaussians import FullGaussian, sym_kl
from bdl_bench.likelihoods import Bernoulli
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.reference import reference_posterior

F64 = torch.float64
REFERENCE = {
    "name": "exact_vi",
    "covariance": "full",
    "expectation": "quadrature",
    "n_quadrature": 16,
    "max_iter": 500,
    "tolerance": 1e-9,
}


def _dataset(seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(80, 3, generator=g, dtype=F64)
    y = (torch.rand(80, generator=g, dtype=F64) < torch.sigmoid(x @ torch.tensor([1.0, -2.0, 0.5], dtype=F64))).to(F64)
    empty = x[:0]
    return Dataset(name="toy", task=Task.BINARY, x_train=x, y_train=y, x_val=empty, y_val=y[:0], x_test=x, y_test=y)


def _model(fill: float) -> torch.nn.Module:
    model = build_model({"name": "logreg", "bias": True}, in_features=3, out_features=1).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def test_reference_is_cached_per_split_and_independent_of_the_model_state(tmp_path: Path) -> None:
    data = _dataset(0)
    model = _model(0.3)
    prior = prior_precision_vector(model, 1.0, None)
    first = reference_posterior(REFERENCE, model, Bernoulli(), prior, data, 0, tmp_path)
    assert isinstance(first, FullGaussian)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    # the same split asked by a method that left the model elsewhere: same key, loaded from the cache
    cached = reference_posterior(REFERENCE, _model(-5.0), Bernoulli(), prior, data, 0, tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    torch.testing.assert_close(cached.mean, first.mean, rtol=0, atol=0)
    # ... and fitting afresh from that other state gives the same posterior (the fit starts at zero)
    fresh = reference_posterior(REFERENCE, _model(-5.0), Bernoulli(), prior, data, 0, None)
    assert float(sym_kl(fresh, first)) < 1e-12
    # another split (or prior) is another reference
    other = reference_posterior(REFERENCE, model, Bernoulli(), prior, _dataset(1), 0, tmp_path)
    reference_posterior(REFERENCE, model, Bernoulli(), prior * 2, data, 0, tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 3
    assert float(sym_kl(other, first)) > 1e-3

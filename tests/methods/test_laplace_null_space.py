"""``method.null_space=deterministic``: τ = 0 with the directions the data do not determine fixed at the MAP (Lee et
al. 2020, App. E.1), against the pseudo-inverse of the autograd GGN's layer blocks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _dense import ggn_by_autograd
from _laplace import make_laplace
from torch import Tensor
from torch.testing import assert_close

from bdl_bench.errors import ConfigError
from bdl_bench.gaussians.blocks import BlockEigenGaussian
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods.base import Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, prior_precision_vector
from bdl_bench.orchestration.runner import run

F64 = torch.float64


def relu_regression() -> tuple[Problem, Tensor, Tensor]:
    """A 1-4-1 ReLU net at hand-set weights on 30 inputs in [0.5, 1.5]. Units 0 and 1 are active on every input, so
    their first-layer columns are collinear (2 null directions there) and so are their outputs with the output bias
    (1 in the last layer); unit 3 is never active (its weight and bias, and its output weight: 3 more); unit 2 only
    for x > 1. So 6 of the 13 directions carry no information."""
    x = torch.linspace(0.5, 1.5, 30, dtype=F64)[:, None]
    y = x[:, 0] ** 3 + 0.1 * torch.randn(30, generator=torch.Generator().manual_seed(0), dtype=F64)
    model = build_model({"name": "mlp", "hidden": [4], "activation": "relu"}, in_features=1, out_features=1).to(F64)
    first, last = (m for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        first.weight.copy_(torch.tensor([[1.0], [2.0], [1.0], [-1.0]]))
        first.bias.copy_(torch.tensor([0.5, 0.1, -1.0, -2.0]))
        last.weight.copy_(torch.tensor([[1.0, -0.5, 2.0, 1.0]]))
        last.bias.fill_(0.1)
    prior = prior_precision_vector(model, 1.0, None)
    return Problem(model, Gaussian(4.0), 30, prior, torch.Generator().manual_seed(1)), x, y


def fitted(**options: object) -> tuple[BlockEigenGaussian, Problem, Tensor, Tensor]:
    problem, x, y = relu_regression()
    method = make_laplace(predictive="sample", **options)
    method.setup(problem)
    method.fit(x, y, n_epochs=0, batch_size=30, data_generator=torch.Generator().manual_seed(2))
    return method.posterior(), problem, x, y


def pinv_blocks(precision: Tensor, blocks: list[slice]) -> tuple[Tensor, int]:
    """Block-diagonal covariance: each block's pseudo-inverse without the eigenvalues <= n·eps x its largest (its
    numerical null space in float64), and how many those are."""
    covariance, n_null = torch.zeros_like(precision), 0
    for s in blocks:
        lam, vec = torch.linalg.eigh(precision[s, s])
        null = lam <= lam.shape[0] * torch.finfo(F64).eps * lam.max()
        n_null += int(null.sum())
        covariance[s, s] = vec @ torch.diag(torch.where(null, 0.0, 1 / lam)) @ vec.mT
    return covariance, n_null


def test_block_with_zero_tau_is_the_pseudo_inverse_of_the_ggn_blocks() -> None:
    q, problem, x, y = fitted(structure="block", prior_precision=0.0, null_space="deterministic")
    theta = flat_params(problem.model).detach()
    precision = problem.n_data * ggn_by_autograd(problem.model, theta, x, y, problem.likelihood)
    covariance, n_null = pinv_blocks(precision, [slice(0, 8), slice(8, 13)])  # [W1, b1], [W2, b2]
    assert isinstance(q, BlockEigenGaussian)
    assert q.n_deterministic == n_null == 6
    assert_close(q.solve(torch.eye(13, dtype=F64)), covariance)
    dead = [3, 7, 11]  # unit 3's weight and bias, its output weight
    assert_close(q.variance()[dead], torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("structure", ["block", "efb", "def"])
def test_with_a_positive_tau_deterministic_changes_nothing(structure: str) -> None:
    """No eigenvalue of N I + τ (τ = 1) is near zero, so the eigenform is the structure's own posterior (for DEF:
    ``dense_blocks`` writes eq. 9 as its Gaussian does)."""
    usual, *_ = fitted(structure=structure, prior_precision=1.0)
    eigen, *_ = fitted(structure=structure, prior_precision=1.0, null_space="deterministic")
    assert isinstance(eigen, BlockEigenGaussian) and eigen.n_deterministic == 0
    assert_close(eigen.to_dense().precision, usual.to_dense().precision)


def test_def_with_zero_tau_fixes_the_dead_unit() -> None:
    """DEF at full rank with τ = 0: the dead unit's row of the first layer's Kronecker grid (its weight and bias)
    has no information in G, nor on the exact diagonal, so it is deterministic; the rest has a finite covariance."""
    q, *_ = fitted(structure="def", rank=None, prior_precision=0.0, null_space="deterministic")
    assert q.n_deterministic >= 3
    variance = q.variance()
    assert bool(variance.isfinite().all())
    assert_close(variance[[3, 7, 11]], torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)
    assert float(variance[[0, 4, 8]].min()) > 0  # unit 0 does carry information


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prior_precision": 0.0}, r"prior_precision=0 leaves the precision singular.*null_space=deterministic"),
        ({"null_space": "deterministic", "structure": "kfac"}, "structure=kfac does not form"),
        ({"null_space": "deterministic", "structure": "block", "search": "marglik"}, "infinite"),
        ({"null_space": "free"}, "unknown null_space 'free'; choices: prior, deterministic"),
        ({"prior_precision": -1.0}, r"prior_precision=-1.0 is out of range: it must be a number >= 0 or null"),
    ],
)
def test_bad_null_space_settings_are_refused_with_the_fix(options: dict[str, object], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        make_laplace(**options)


def test_a_run_with_zero_tau_reports_its_deterministic_directions(tmp_path: Path, compose_cfg) -> None:
    overrides = ["method.structure=block", "method.prior_precision=0", "method.null_space=deterministic"]
    cfg = compose_cfg(["method=laplace", "data=toy/cubic", "method.predictive=sample", *overrides])
    metrics = run(cfg, tmp_path).metrics
    assert metrics["n_deterministic"] >= 1  # a 1-D input: first-layer units active on the same inputs
    assert math.isfinite(metrics["test_ll"]) and math.isfinite(metrics["rmse"])


def test_a_layer_too_large_for_a_dense_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from bdl_bench.methods.laplace import structures

    monkeypatch.setattr(structures, "MAX_DENSE_BLOCK", 5)  # the first layer has 8 parameters, the last 5
    with pytest.raises(ConfigError, match="layer 0 has 8 parameters .limit 5.; use null_space=prior"):
        fitted(structure="def", prior_precision=0.0, null_space="deterministic")

"""The post-training low-rank study of mean-field standard deviations (k-tied paper, Sec. 2)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.data.base import Dataset, Task
from bdl_bench.likelihoods import Bernoulli, Gaussian
from bdl_bench.methods._diag_vi import standard_normal
from bdl_bench.metrics import brier_score, predictive_metrics
from bdl_bench.studies.low_rank_std import (
    MeanFieldNetwork,
    explained_variance,
    low_rank_nonnegative,
    low_rank_study,
    spectra,
    weight_sample_metrics,
    with_low_rank_std,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "methods"))
from _vi_helpers import make_method, make_problem  # noqa: E402


def _classification(seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(120, 3, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).float()
    empty = torch.zeros(0, 3)
    return Dataset("toy", Task.BINARY, x[:80], y[:80], empty, torch.zeros(0), x[80:], y[80:])


def _network(seed: int = 0) -> MeanFieldNetwork:
    """A gmfvi posterior over a 3-24-24-1 MLP, with stds made random (as after training)."""
    method = make_method("gmfvi")
    method.setup(make_problem(3, Bernoulli(), seed=seed))
    with torch.no_grad():
        method.rho.add_(torch.rand(method.rho.shape, generator=torch.Generator().manual_seed(seed)))
    return MeanFieldNetwork.from_method(method)


def test_explained_variance_of_a_constructed_matrix() -> None:
    u, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    singular = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    matrix = u[:, :4] @ torch.diag(singular) @ v.T
    assert_close(explained_variance(matrix), torch.tensor([9.0, 4.0, 1.0, 0.0], dtype=torch.float64) / 14)


def test_low_rank_approximation_stays_positive_and_is_exact_at_full_rank() -> None:
    g = torch.Generator().manual_seed(0)
    std = torch.rand(5, 7, generator=g) + 0.05
    rank_1 = low_rank_nonnegative(std, 1)
    assert bool((rank_1 > 0).all())
    assert torch.linalg.matrix_rank(rank_1.double(), rtol=1e-5) == 1
    assert float(low_rank_nonnegative(std, 2).min()) >= float(std.min())  # clamped at the smallest entry
    assert_close(low_rank_nonnegative(std, 5), std)
    exact = torch.outer(torch.rand(5, generator=g) + 0.1, torch.rand(7, generator=g) + 0.1)
    assert_close(low_rank_nonnegative(exact, 1), exact)
    with pytest.raises(ValueError, match="rank"):
        low_rank_nonnegative(std, 0)


def test_replacing_stds_touches_only_weight_matrices() -> None:
    net = _network()
    assert [m.label for m in net.matrices] == ["dense 1", "dense 2", "dense 3"] and net.dense
    approx = with_low_rank_std(net, 1)
    for before, after in zip(net.weight_stds(), approx.weight_stds()):
        if min(before.shape) > 1:
            assert torch.linalg.matrix_rank(after.double(), rtol=1e-5) == 1
            assert not torch.allclose(after, before)
    for position in (1, 3, 5):  # the three biases
        assert_close(approx.split(approx.std)[position], net.split(net.std)[position])
    assert_close(approx.mean, net.mean)
    frame = spectra(net)
    assert set(frame["parameter"]) == {"std", "mean"}
    sums = frame.groupby(["layer", "parameter"])["fraction"].sum()
    assert_close(torch.tensor(sums.to_numpy()), torch.ones(len(sums), dtype=torch.float64), atol=1e-5, rtol=0)


def test_weight_sample_metrics_match_explicit_samples() -> None:
    net, data, likelihood = _network(), _classification(), Bernoulli()
    out = weight_sample_metrics(net, data, likelihood, n_samples=5, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    thetas = net.mean + net.std * standard_normal((5, net.mean.numel()), g, net.mean)
    from bdl_bench.methods._layerwise_vi import forward_flat_params

    f_test = forward_flat_params(net.model, thetas, data.x_test)
    nll = torch.stack([likelihood.nll(f, data.y_test).mean() for f in f_test])
    assert out["nll_mean"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert out["nll_sem"] == pytest.approx(float(nll.std() / math.sqrt(5)), rel=1e-4)
    probs = [likelihood.probs(f.unsqueeze(0)) for f in f_test]
    brier = torch.tensor([brier_score(q, data.y_test) for q in probs], dtype=torch.float64)
    assert out["brier_mean"] == pytest.approx(float(brier.mean()), rel=1e-6)  # Table 3's is this minus 1 (TFP's)
    assert out["brier_sem"] == pytest.approx(float(brier.std() / math.sqrt(5)), rel=1e-5)
    ensemble = predictive_metrics(likelihood, f_test, data.y_test)
    assert out["ensemble_ece"] == pytest.approx(ensemble["ece"], rel=1e-5)
    assert out["ensemble_accuracy"] == pytest.approx(ensemble["accuracy"])
    assert {"neg_elbo_mean", "accuracy_mean", "brier_mean", "brier_sem", "kl"} <= set(out)


def test_study_rows_share_noise_and_count_std_parameters() -> None:
    net, data = _network(), _classification()
    table = low_rank_study(
        net, data, Bernoulli(), ranks=(1, 24), n_samples=4, generator=torch.Generator().manual_seed(0)
    )
    assert list(table["approximation"]) == ["mean_field", "rank_1", "rank_24"]
    # layers 3→24, 24→24, 24→1: mn stds, or min(k, m, n)(m + n)
    assert list(table["n_std_params"]) == [72 + 576 + 24, 27 + 48 + 25, 3 * 27 + 24 * 48 + 25]
    full, rank_24 = table.iloc[0], table.iloc[2]
    # rank 24 keeps layers 1 and 3 exactly and layer 2 up to rounding: the same draws give the same metrics
    assert rank_24["nll_mean"] == pytest.approx(full["nll_mean"], rel=1e-4)


def test_from_a_run_folder(tmp_path: Path, compose_cfg) -> None:  # noqa: ANN001
    from bdl_bench.orchestration.runner import run

    cfg = compose_cfg(["method=gmfvi", "data=uci/boston", "model.hidden=[8]", "trainer.n_epochs=1"])
    run(cfg, tmp_path)
    net, dataset, likelihood = MeanFieldNetwork.from_run(tmp_path)
    assert isinstance(likelihood, Gaussian)
    assert [s.shape for s in net.weight_stds()] == [(8, 13), (1, 8)]
    table = low_rank_study(
        net, dataset, likelihood, ranks=(1,), n_samples=3, generator=torch.Generator().manual_seed(0)
    )
    assert {"rmse_mean", "ensemble_rmse", "ensemble_test_ll"} <= set(table.columns)
    assert table["neg_elbo_mean"].notna().all()


def test_std_heatmaps_error_is_the_truncations(tmp_path: Path, compose_cfg) -> None:  # noqa: ANN001
    """Fig. 4's numbers: each panel's relative Frobenius error is that of the clamped rank-k truncation of the run's
    std matrix, 0 for the matrix itself and decreasing in k; an unknown matrix name lists the ones there are."""
    import dataclasses

    from bdl_bench.errors import ResultsError
    from bdl_bench.gaussians.io import load_gaussian, save_gaussian
    from bdl_bench.orchestration.runner import run
    from bdl_bench.report.ktied import std_heatmaps

    cfg = compose_cfg(["method=gmfvi", "data=uci/boston", "model.hidden=[8]", "trainer.n_epochs=1"])
    run(cfg, tmp_path / "run")
    q = load_gaussian(tmp_path / "run" / "posterior.pt")  # stds made random, as after a long training
    noise = torch.rand(q.prec_diag.shape, generator=torch.Generator().manual_seed(0), dtype=q.prec_diag.dtype)
    save_gaussian(dataclasses.replace(q, prec_diag=q.prec_diag * (0.2 + noise)), tmp_path / "run" / "posterior.pt")
    png, table, text = std_heatmaps(tmp_path, tmp_path / "fig4.png", "dense 1", [1, 2])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "| rank-2 approximation |" in text
    net, _, _ = MeanFieldNetwork.from_run(tmp_path / "run")
    exact = net.weight_stds()[0].double()
    expected = [float(torch.linalg.matrix_norm(exact - low_rank_nonnegative(exact, k)) / torch.linalg.matrix_norm(exact))
                for k in (1, 2)]  # fmt: skip
    errors = table.set_index("rank")["relative_error"]
    assert errors[0] == 0 and errors[1] == pytest.approx(expected[0]) and errors[2] == pytest.approx(expected[1])
    assert errors[1] > errors[2] > 0
    with pytest.raises(ResultsError, match="has no matrix 'conv 1'; it has dense 1, dense 2"):
        std_heatmaps(tmp_path, tmp_path / "x.png", "conv 1", [1])

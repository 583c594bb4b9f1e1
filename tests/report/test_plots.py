"""`bdl-bench plot covariance` (SLANG Fig. 1) draws one panel per method from the runs' posterior.pt."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import torch

from bdl_bench.gaussians import DiagGaussian, FullGaussian
from bdl_bench.gaussians.io import save_gaussian
from bdl_bench.report.plots import main, plot_covariance
from bdl_bench.results import write_config, write_metrics


def _run(root: Path, name: str, method: dict, gaussian) -> None:
    run_dir = root / name
    write_config(run_dir, {"data": {"name": "libsvm/usps_3vs5", "split": 0}, "method": method})
    write_metrics(run_dir, {"nll": 0.1})
    save_gaussian(gaussian, run_dir / "posterior.pt")


def test_covariance_figure_has_a_panel_per_requested_method(tmp_path: Path) -> None:
    torch.manual_seed(0)
    factor = torch.randn(6, 6, dtype=torch.float64)
    precision = factor @ factor.T + 6 * torch.eye(6, dtype=torch.float64)
    _run(
        tmp_path,
        "full",
        {"name": "exact_vi", "covariance": "full"},
        FullGaussian(torch.zeros(6, dtype=torch.float64), precision),
    )
    _run(
        tmp_path,
        "diag",
        {"name": "exact_vi", "covariance": "diag"},
        DiagGaussian(torch.zeros(6, dtype=torch.float64), precision.diagonal().clone()),
    )
    out, table = plot_covariance(
        tmp_path, tmp_path / "fig.png", methods=["exact_vi covariance=full", "exact_vi covariance=diag"]
    )
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 100 and image.shape[1] > 2.5 * image.shape[0]  # one row of 3 panels (2 maps + std)
    # against the first method, the full Gaussian: itself exactly; the diagonal one (variances 1 / diag(precision))
    # has no off-diagonal covariance at all (error 1) and the variances of the precision's diagonal
    full = torch.linalg.inv(precision)
    assert list(table["method"]) == ["exact_vi covariance=full", "exact_vi covariance=diag"]
    assert table.iloc[0][["offdiag_error", "variance_ratio", "variance_corr"]].tolist() == pytest.approx([0, 1, 1])
    assert table["offdiag_error"].iloc[1] == pytest.approx(1.0)
    ratio = (1 / precision.diagonal()) / full.diagonal()
    assert table["variance_ratio"].iloc[1] == pytest.approx(float(ratio.median()))
    assert table["variance_ratio"].iloc[1] < 1  # mean field underestimates the variances (Fig. 1)
    with pytest.raises(ValueError, match="no runs with posterior.pt"):
        plot_covariance(tmp_path, tmp_path / "none.png", dataset="australian")


@pytest.mark.parametrize("n_epochs, xscale", [(20, "linear"), (300, "log")])
def test_convergence_figure_averages_each_method_over_its_runs(tmp_path: Path, n_epochs: int, xscale: str) -> None:
    """Fig. 4: a row per dataset, a line per method (the mean over its splits); long runs get a log epoch axis."""
    import pandas as pd

    from bdl_bench.report.plots import convergence_figure

    for rank in (16, 5):
        for split in (0, 1):
            run_dir = tmp_path / f"slang{rank}_{split}"
            write_config(
                run_dir,
                {"data": {"name": "libsvm/australian", "split": split}, "method": {"name": "slang", "rank": rank}},
            )
            write_metrics(run_dir, {"nll": 0.3})
            epochs = range(1, n_epochs + 1)
            history = {"epoch": epochs, "train/elbo": [-(1.0 + split + rank / e) for e in epochs]}
            losses = {"test/nll": 0.3 + split, "test/test_ll_joint": -(0.2 + split)}
            pd.DataFrame(history).assign(**losses).to_csv(run_dir / "history.csv", index=False)
    fig = convergence_figure(tmp_path)
    (elbo_axis, nll_axis) = fig.axes
    assert elbo_axis.get_xscale() == xscale and nll_axis.get_xscale() == xscale
    lines = {line.get_label(): line for line in elbo_axis.get_lines()}
    assert list(lines) == ["slang rank=5", "slang rank=16"]  # numbers in labels by value, as the tables
    # the mean over splits 0 and 1 of 1 + split + rank / epoch, at epoch 1 for rank 5
    assert lines["slang rank=5"].get_ydata()[0] == pytest.approx(1.5 + 5.0)
    assert nll_axis.get_lines()[0].get_ydata()[0] == pytest.approx(0.8)  # the mean over splits of 0.3 + split
    # the SLANG authors' BNN curve (Fig. 4 right): the joint test log-loss, -test_ll_joint
    joint = convergence_figure(tmp_path, test_loss="nll_joint").axes[1]
    assert joint.get_lines()[0].get_ydata()[0] == pytest.approx(0.7) and "joint" in joint.get_title()
    with pytest.raises(ValueError, match="test_loss 'brier': choose one of nll, nll_joint"):
        convergence_figure(tmp_path, test_loss="brier")
    with pytest.raises(ValueError, match="none of the methods .*found: slang rank=16, slang rank=5"):
        convergence_figure(tmp_path, methods=["bbb"])
    # one split's runs, their histories kept gzipped (the committed pieces of a long reproduction)
    for history in tmp_path.glob("slang*_1/history.csv"):
        pd.read_csv(history).to_csv(history.with_name("history.csv.gz"), index=False)
        history.unlink()
    assert convergence_figure(tmp_path, split=1).axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(2 + 5.0)
    main([str(tmp_path), "convergence", "--split", "1", "--out", str(tmp_path / "fig4.png")])  # bdl-bench plot
    assert (tmp_path / "fig4.png").read_bytes()[:4] == b"\x89PNG"


def test_covariance_figure_of_a_dataset_without_runs_says_so(tmp_path: Path) -> None:
    """A figure spec naming a dataset the folder has no runs of (``reproduce slang_table1`` on a subset of
    the sets, Fig. 1 being USPS's) raises the one ResultsError that reproduce reports as a skipped figure."""
    _run(tmp_path, "diag", {"name": "exact_vi", "covariance": "diag"}, DiagGaussian(torch.zeros(3), torch.ones(3)))
    with pytest.raises(ValueError, match="no runs with posterior.pt for dataset 'australian'"):
        plot_covariance(tmp_path, tmp_path / "fig.png", dataset="australian", methods=["exact_vi covariance=diag"])


def test_covariance_figure_without_its_reference_run_says_so(tmp_path: Path) -> None:
    """The first method is the one the others are compared with: without its run the figure is not drawn (a
    reproduction still running would otherwise compare with whichever method finished first)."""
    _run(tmp_path, "diag", {"name": "exact_vi", "covariance": "diag"}, DiagGaussian(torch.zeros(3), torch.ones(3)))
    _run(tmp_path, "other", {"name": "exact_vi", "covariance": "kron"}, DiagGaussian(torch.zeros(3), torch.ones(3)))
    with pytest.raises(ValueError, match="no exact_vi covariance=full run .* the other methods are compared with it"):
        plot_covariance(
            tmp_path, tmp_path / "fig.png", methods=["exact_vi covariance=full", "exact_vi covariance=diag"]
        )

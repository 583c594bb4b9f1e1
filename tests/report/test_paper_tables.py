"""Paper-table specs of DEF Table 1 and k-tied Table 3: our runs land in the paper's columns, beside its values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bdl_bench.report.paper import get_paper_table
from bdl_bench.report.tables import build_table
from bdl_bench.results import write_config, write_metrics


def _fake_run(root: Path, name: str, config: dict, metrics: dict) -> None:
    run_dir = root / name
    write_config(run_dir, config)
    write_metrics(run_dir, metrics)


DEF_METHODS = {
    "nn": {"name": "map", "lr": 0.001},
    "diag": {"name": "laplace", "structure": "diag"},
    "kfac": {"name": "laplace", "structure": "kfac"},
    "efb": {"name": "laplace", "structure": "efb"},
    "def": {"name": "laplace", "structure": "def"},
    "mc_dropout": {"name": "dropout", "dropout_rate": 0.6},
    "ensemble15": {"name": "ensemble", "n_members": 15},
}


def test_def_table1_puts_each_variant_beside_the_papers_mnist_column(tmp_path: Path) -> None:
    for column, method in DEF_METHODS.items():
        for seed in (0, 1):
            _fake_run(
                tmp_path,
                f"{column}{seed}",
                {
                    "data": {"name": "vision/mnist", "ood": "notmnist"},
                    "method": method,
                    "trainer": {"seed": seed},
                    "paper_table": "def_table1",
                },
                {"accuracy": 0.99 + seed * 0.002, "ece": 0.01, "ood_entropy_mean": 0.5, "ood_entropy_std": 0.2},
            )
    table = build_table(tmp_path)
    frame = table.frame.set_index("method")
    assert set(frame.index) == set(DEF_METHODS)
    assert (frame["dataset"] == "mnist").all() and (frame["n_runs"] == 2).all()
    assert frame.loc["def", "accuracy"] == pytest.approx(0.991)
    assert frame.loc["def", "paper_accuracy"] == pytest.approx(0.9927)
    assert frame.loc["nn", "paper_ece"] == pytest.approx(0.395)
    assert frame.loc["mc_dropout", "paper_ood_entropy_mean"] == pytest.approx(0.562)
    assert frame.loc["ensemble15", "paper_ood_entropy_std"] == pytest.approx(0.133)
    assert frame.loc["kfac", "paper_ece"] == pytest.approx(0.0078)
    assert math.isnan(frame.loc["diag", "paper_accuracy_se"])  # the paper prints no standard errors
    assert "Paper table: def_table1" in table.markdown
    assert "| mnist | def | 2 | 0.991 ± 0.001 | 0.993 |" in table.markdown
    assert "On the paper's numbers: the paper's MNIST NN ECE of 0.395 cannot be right" in table.markdown


def test_def_table1_has_no_value_where_the_paper_has_none() -> None:
    spec = get_paper_table("def_table1")
    assert spec.lookup("cifar10", "mc_dropout", "accuracy") is None  # omitted on CIFAR in the paper
    assert spec.lookup("cifar10", "def", "ece").value == pytest.approx(0.0084)
    assert spec.lookup("mnist", "block", "accuracy") is None
    assert spec.column({"method.name": "ensemble", "method.n_members": 5.0}) == "ensemble5"


def test_ktied_fig6_scales_accuracy_to_percent_and_flips_the_elbo(tmp_path: Path) -> None:
    methods = {
        "mean_field": {"name": "gmfvi", "lr": 0.001},
        "1_tied": {"name": "ktied", "k": 1, "lr": 0.001},
        "2_tied": {"name": "ktied", "k": 2, "lr": 0.001},
        "3_tied": {"name": "ktied", "k": 3, "lr": 0.001},
    }
    for column, method in methods.items():
        _fake_run(
            tmp_path,
            column,
            {"data": {"name": "vision/mnist"}, "method": method, "paper_table": "ktied_fig6"},
            {"elbo": -0.52, "nll": 0.13, "accuracy": 0.968},
        )
    table = build_table(tmp_path)
    frame = table.frame.set_index("method")
    assert set(frame.index) == set(methods)
    row = frame.loc["2_tied"]
    assert row["neg_elbo"] == pytest.approx(0.52)
    assert row["paper_neg_elbo"] == pytest.approx(0.520) and row["paper_neg_elbo_se"] == pytest.approx(0.0063)
    assert row["accuracy_percent"] == pytest.approx(96.8)
    assert row["paper_accuracy_percent"] == pytest.approx(96.8)
    assert row["paper_nll"] == pytest.approx(0.129)
    assert bool(row["within_2se_accuracy_percent"]) and bool(row["within_2se_neg_elbo"])
    assert frame.loc["mean_field", "paper_nll"] == pytest.approx(0.133)
    assert frame.loc["1_tied", "paper_accuracy_percent"] == pytest.approx(96.1)
    assert not bool(frame.loc["1_tied", "within_2se_accuracy_percent"])  # 96.8 vs 96.1 ± 0.19
    assert "| mnist | 3_tied | 1 | 0.520 | 0.497 ± 0.006 |" in table.markdown


def test_experiment_yamls_name_their_paper_tables() -> None:
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf" / "experiment"
    for name in ("def_table1", "ktied_fig6"):
        assert OmegaConf.load(conf / f"{name}.yaml").paper_table == name
        get_paper_table(name)


def test_a_grid_tables_values_carry_their_printed_rounding() -> None:
    """SLANG Table 1 and DEF Table 1 print no SEs, so a cell's agreement band is its rounding: a1a's one split
    with its printed 0.369 stands for [0.3685, 0.3695]."""
    from bdl_bench.report.paper import get_paper_table

    value = get_paper_table("slang_table1").lookup("a1a", "full_ef", "neg_elbo_per_example")
    assert value.value == pytest.approx(0.369) and value.rounding == pytest.approx(0.0005)
    assert value.band(float("nan")) == pytest.approx(0.0005)
    ece = get_paper_table("def_table1").lookup("mnist", "diag", "ece")
    assert ece.value == pytest.approx(0.0075) and ece.rounding == pytest.approx(0.00005)

"""`bdl-bench table`: grouping, standard errors with the real count, paper values beside ours."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from bdl_bench.report.paper import get_paper_table
from bdl_bench.report.tables import build_table
from bdl_bench.results import update_run_record, write_config, write_metrics


def _fake_run(root: Path, name: str, config: dict, metrics: dict) -> None:
    run_dir = root / name
    write_config(run_dir, config)
    write_metrics(run_dir, metrics)


def test_mean_and_standard_error_use_the_real_count(tmp_path: Path) -> None:
    for split, rmse in enumerate([3.0, 4.0, 5.0]):
        _fake_run(
            tmp_path,
            f"bbb{split}",
            {"data": {"name": "uci/boston", "split": split}, "method": {"name": "bbb"}, "paper_table": "slang_table2"},
            {"rmse": rmse, "test_ll": -2.5},
        )
    _fake_run(tmp_path, "unfinished", {"data": {"name": "uci/boston"}, "method": {"name": "bbb"}}, {})
    (tmp_path / "unfinished" / "metrics.json").unlink()
    table = build_table(tmp_path)
    row = table.frame.set_index("method").loc["bbb"]
    assert row["n_runs"] == 3
    assert row["rmse"] == pytest.approx(4.0)
    assert row["rmse_se"] == pytest.approx(1.0 / math.sqrt(3))  # sample std 1, ddof = 1
    assert row["paper_rmse"] == pytest.approx(3.43) and row["paper_rmse_se"] == pytest.approx(0.20)
    # |4.0 − 3.43| = 0.57 ≤ 2·sqrt(0.577² + 0.2²) = 1.22
    assert bool(row["within_2se_rmse"])
    assert "| boston | bbb | 3 | 4.000 ± 0.577 | 3.430 ± 0.200 |" in table.markdown


def test_generic_labels_name_the_varying_option(tmp_path: Path) -> None:
    for rank in (1, 5):
        _fake_run(
            tmp_path,
            f"slang{rank}",
            {"data": {"name": "libsvm/australian"}, "method": {"name": "slang", "rank": rank, "lr": 0.05}},
            {"nll": 0.3 + rank / 100},
        )
    table = build_table(tmp_path, metrics=["nll"])
    assert set(table.frame["method"]) == {"slang rank=1", "slang rank=5"}


def test_a_setting_null_in_one_run_and_set_in_another_splits_the_rows(tmp_path: Path) -> None:
    """def_toy's DEF at full rank (``method.rank: null``) and rank 1 are two rows, never one mean of both; a key
    that some runs lack altogether (an option added since) still does not split them."""
    for rank, test_ll in ((None, -11.68), (1, -61.62)):
        _fake_run(
            tmp_path,
            f"def_rank{rank}",
            {"data": {"name": "toy/cubic"}, "method": {"name": "laplace", "structure": "def", "rank": rank}},
            {"test_ll": test_ll},
        )
    _fake_run(tmp_path, "older", {"data": {"name": "toy/cubic"}, "method": {"name": "laplace", "structure": "def"}}, {})
    (tmp_path / "older" / "metrics.json").unlink()  # unfinished: not in the table
    table = build_table(tmp_path, metrics=["test_ll"]).frame.set_index("method")
    assert set(table.index) == {"laplace rank=null", "laplace rank=1"}
    assert table.loc["laplace rank=null", "test_ll"] == pytest.approx(-11.68)
    assert table.loc["laplace rank=1", "n_runs"] == 1
    for split in (0, 1):  # a key only the newer run has does not split a row
        config = {"data": {"name": "toy/cubic", "split": split}, "method": {"name": "map"}}
        if split:
            config["method"]["new_option"] = None
        _fake_run(tmp_path / "maps", f"map{split}", config, {"test_ll": -3.0})
    assert set(build_table(tmp_path / "maps", metrics=["test_ll"]).frame["method"]) == {"map"}


def test_a_row_of_runs_from_different_devices_is_warned_about(tmp_path: Path) -> None:
    for split, device in enumerate(["cpu", "cuda", "cpu"]):
        _fake_run(
            tmp_path, f"map{split}", {"data": {"name": "uci/boston", "split": split}, "method": {"name": "map"}}, {}
        )
        update_run_record(tmp_path / f"map{split}", device=device)
    _fake_run(tmp_path, "bbb", {"data": {"name": "uci/boston"}, "method": {"name": "bbb"}}, {"rmse": 3.0})
    for name in ("map0", "map1", "map2"):
        write_metrics(tmp_path / name, {"rmse": 3.0})
    table = build_table(tmp_path)
    assert table.warnings == ("boston / map: its runs come from different devices (cpu, cuda)",)


def test_table1_columns_scale_and_sign() -> None:
    spec = get_paper_table("slang_table1")
    assert spec.column({"method.name": "vogn", "method.covariance": "diag", "method.curvature": "ef"}) == "mf_ef"
    assert spec.column({"method.name": "exact_vi", "method.covariance": "full"}) == "full_exact"
    assert spec.column({"method.name": "slang", "method.rank": 5}) == "slang_L5"
    assert spec.lookup("australian", "slang_L1", "sym_kl_vs_full_exact").value == pytest.approx(0.033)
    assert spec.scale("australian", "sym_kl_vs_full_exact") == pytest.approx(1e4)
    assert spec.metrics["sym_kl"] == ("sym_kl_vs_full_exact", 0.5)  # the authors average KL(p||q) and KL(q||p)
    assert spec.metrics["elbo_no_bias_logdet"] == ("neg_elbo_per_example", -1.0)


def test_no_runs_and_unknown_paper_table(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no finished runs"):
        build_table(tmp_path)
    with pytest.raises(ValueError, match="unknown paper table 'nope'; available: .*slang_table1"):
        get_paper_table("nope")


def test_table3_error_shown_in_percent(tmp_path: Path) -> None:
    for seed, error in enumerate([0.018, 0.020]):
        _fake_run(
            tmp_path,
            f"r{seed}",
            {"data": {"name": "vision/mnist"}, "method": {"name": "slang", "rank": 32}, "paper_table": "slang_table3"},
            {"error": error},
        )
    row = build_table(tmp_path).frame.iloc[0]
    assert row["method"] == "slang_L32"
    assert row["test_error_percent"] == pytest.approx(1.9)
    assert row["paper_test_error_percent"] == pytest.approx(1.73)


def test_rows_order_numbers_in_labels_by_value(tmp_path: Path) -> None:
    # Table 3's columns in the paper's order (L = 2 before L = 16), not the strings' (slang_L16 before slang_L2)
    for rank in (16, 2, 32, 1):
        _fake_run(
            tmp_path,
            f"r{rank}",
            {
                "data": {"name": "vision/mnist"},
                "method": {"name": "slang", "rank": rank},
                "paper_table": "slang_table3",
            },
            {"error": 0.02},
        )
    table = build_table(tmp_path)
    assert list(table.frame["method"]) == ["slang_L1", "slang_L2", "slang_L16", "slang_L32"]
    assert table.markdown.index("slang_L2 ") < table.markdown.index("slang_L16 ")


def _table3_run(root: Path, name: str, rank: int, prior: float, lr: float, val_error: float, error: float) -> None:
    _fake_run(
        root,
        name,
        {
            "data": {"name": "vision/mnist"},
            "method": {"name": "slang", "rank": rank, "lr": lr},
            "prior_precision": prior,
            "paper_table": "slang_table3",
        },
        {"error": error, "val_error": val_error},
    )


def test_table3_keeps_the_setting_chosen_on_validation_not_on_test(tmp_path: Path) -> None:
    # Setting A has the better validation error, setting B the better test error: A must be reported.
    for seed in (0, 1):
        _table3_run(tmp_path, f"a{seed}", 8, 1.0, 0.1, val_error=0.018 + seed * 1e-3, error=0.021)
        _table3_run(tmp_path, f"b{seed}", 8, 7.389, 0.01, val_error=0.025, error=0.015)
    table = build_table(tmp_path)
    row = table.frame.set_index("method").loc["slang_L8"]
    assert row["n_runs"] == 2
    assert row["test_error_percent"] == pytest.approx(2.1)
    assert row["paper_test_error_percent"] == pytest.approx(1.92)
    assert row["chosen_on_validation"].startswith("prior_precision=1, method.lr=0.1 (val_error 0.0185; 2 settings)")
    assert "chosen on validation" in table.markdown


def test_a_key_only_some_columns_have_is_no_setting_of_the_others(tmp_path: Path) -> None:
    """SLANG's method.decay is absent from BBB's runs: BBB's setting is described without it."""
    for name, method, error in (
        ("slang", {"name": "slang", "rank": 2, "lr": 0.1, "decay": 0.6}, 0.033),
        ("bbb", {"name": "bbb", "lr": 0.001}, 0.025),
    ):
        config = {"data": {"name": "vision/mnist"}, "method": method, "prior_precision": 54.598}
        _fake_run(tmp_path, name, {**config, "paper_table": "slang_table3"}, {"error": error, "val_error": error})
    frame = build_table(tmp_path).frame.set_index("method")
    assert frame.loc["bbb", "chosen_on_validation"] == "prior_precision=54.598, method.lr=0.001 (the only setting run)"
    assert frame.loc["slang_L2", "chosen_on_validation"] == (
        "prior_precision=54.598, method.lr=0.1, method.decay=0.6 (the only setting run)"
    )


def test_selection_without_the_validation_metric_says_so(tmp_path: Path) -> None:
    for prior in (1.0, 7.389):
        _fake_run(
            tmp_path,
            f"r{prior}",
            {
                "data": {"name": "vision/mnist"},
                "method": {"name": "bbb"},
                "prior_precision": prior,
                "paper_table": "slang_table3",
            },
            {"error": 0.02},
        )
    with pytest.raises(ValueError, match="val_error"):
        build_table(tmp_path)


def test_slang_table2_puts_the_authors_joint_ll_beside_their_slang_and_bbb_columns() -> None:

    spec = get_paper_table("slang_table2")
    assert {"test_ll", "test_ll_joint"} <= set(spec.metrics)
    slang = spec.lookup("boston", "slang", "test_ll_joint")
    assert slang is not None and slang == spec.lookup("boston", "slang", "test_ll")
    assert spec.lookup("boston", "bbb", "test_ll_joint") is not None
    assert spec.lookup("boston", "dropout", "test_ll_joint") is None  # Gal's dropout numbers: the usual mixture


def test_relative_to_pairs_runs_by_split_and_differences_the_paper_columns(tmp_path: Path) -> None:
    """``relative_to``: each run minus the reference method's run on the same split (paired), the paper's
    value minus its reference column; a split without a reference run drops out; SE is the paired one."""
    elbos = {"full_exact": [-0.55, -0.57, -0.60], "mf_exact": [-0.58, -0.61, -0.63, -0.70]}
    for column, values in elbos.items():
        covariance = column.split("_")[0].replace("mf", "diag")
        for split, elbo in enumerate(values):
            config = {
                "data": {"name": "libsvm/australian", "split": split},
                "method": {"name": "exact_vi", "covariance": covariance},
                "paper_table": "slang_table1",
            }
            _fake_run(tmp_path, f"{column}{split}", config, {"elbo_no_bias_logdet": elbo, "nll": 0.3})
    table = build_table(tmp_path, metrics=["elbo_no_bias_logdet"], relative_to="full_exact")
    row = table.frame.set_index("method").loc["mf_exact"]
    gaps = [0.03, 0.04, 0.03]  # negative ELBO of mf_exact minus full_exact's, splits 0-2 (split 3 has no partner)
    assert row["n_runs"] == 3 and row["neg_elbo_per_example"] == pytest.approx(statistics.mean(gaps))
    assert row["neg_elbo_per_example_se"] == pytest.approx(statistics.stdev(gaps) / math.sqrt(3))
    assert row["paper_neg_elbo_per_example"] == pytest.approx(0.593 - 0.559)  # the paper's columns, differenced
    assert table.frame.set_index("method").loc["full_exact", "neg_elbo_per_example"] == pytest.approx(0.0)
    assert table.markdown.startswith("Differences to full_exact")
    with pytest.raises(ValueError, match="no runs of method 'slang_L1'.*full_exact, mf_exact"):
        build_table(tmp_path, metrics=["elbo_no_bias_logdet"], relative_to="slang_L1")


def test_a_paper_cell_printed_as_zero_stands_for_half_a_unit_of_its_last_digit(tmp_path: Path) -> None:
    """SLANG's naval rmse is printed 0.00 ± 0.00: a measured 0.001 ± 0.0001 agrees with it (the printed value
    stands for [−0.005, 0.005] and its SE for at most 0.005), which the bare two-SE band (2·0.0001) refuses."""
    for split, rmse in enumerate([0.0011, 0.0012, 0.0010, 0.0009]):
        _fake_run(
            tmp_path,
            f"slang{split}",
            {"data": {"name": "uci/naval", "split": split}, "method": {"name": "slang"}, "paper_table": "slang_table2"},
            {"rmse": rmse, "test_ll": 4.76},
        )
    row = build_table(tmp_path).frame.set_index("method").loc["slang"]
    assert row["paper_rmse"] == 0.0 and row["paper_rmse_se"] == 0.0 and row["paper_rmse_rounding"] == 0.005
    assert abs(row["rmse"] - row["paper_rmse"]) > 2 * row["rmse_se"]  # the rule without rounding says no
    assert bool(row["within_2se_rmse"])
    ref = get_paper_table("slang_table2").lookup("naval", "slang", "rmse")
    assert ref is not None and ref.band(0.0) == pytest.approx(2 * 0.005 + 0.005)
    # a value two units off the printed 0.00 ± 0.00 still disagrees
    assert ref.band(0.0001) < 0.02


def test_half_unit_of_the_last_printed_digit() -> None:
    from bdl_bench.report.paper import half_unit

    assert half_unit("0.08") == pytest.approx(0.005)
    assert half_unit("-2.6") == pytest.approx(0.05)
    assert half_unit("12") == pytest.approx(0.5)
    assert half_unit("1.5e-3") == pytest.approx(0.5e-4)


def test_a_cut_metrics_file_is_skipped_with_one_warning_or_refused_when_strict(tmp_path: Path, capsys) -> None:
    from bdl_bench.errors import ResultsError

    for split in range(3):
        _fake_run(
            tmp_path,
            f"r{split}",
            {"data": {"name": "uci/boston", "split": split}, "method": {"name": "map"}},
            {"rmse": 3.0 + split},
        )
    cut = tmp_path / "r1" / "metrics.json"
    cut.write_text(cut.read_text()[:12])
    table = build_table(tmp_path)
    assert table.frame.set_index("method").loc["map", "n_runs"] == 2
    assert table.frame.set_index("method").loc["map", "rmse"] == pytest.approx(4.0)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: skipped {cut}: unreadable or cut short")
    with pytest.raises(ResultsError, match="r1/metrics.json: unreadable or cut short"):
        build_table(tmp_path, strict=True)


def test_rows_never_average_over_settings_but_do_over_splits_seeds_and_paths(tmp_path: Path) -> None:
    for prior in (1.0, 10.0):
        for split in (0, 1):
            _fake_run(
                tmp_path,
                f"p{prior}s{split}",
                {
                    "data": {"name": "uci/boston", "split": split, "root": f"/data/{split}"},
                    "method": {"name": "map", "map_dir": f"/maps/{split}"},
                    "trainer": {"seed": split, "n_epochs": 10},
                    "prior_precision": prior,
                    "results_root": f"/results/{split}",
                },
                {"rmse": prior + split},
            )
    frame = build_table(tmp_path, metrics=["rmse"]).frame.set_index("method")
    assert sorted(frame.index) == ["map prior_precision=1", "map prior_precision=10"]
    assert frame.loc["map prior_precision=10", "n_runs"] == 2
    assert frame.loc["map prior_precision=10", "rmse"] == pytest.approx(10.5)


def test_rows_split_by_the_keys_of_a_mapping_valued_option(tmp_path: Path) -> None:
    # two marglik searches that differ only in which key each one sets: not one row of 4 runs
    for search, tag in (({"marglik": {"noise": False}}, "a"), ({"marglik": {"prior": "scalar"}}, "b")):
        for split in (0, 1):
            _fake_run(
                tmp_path,
                f"{tag}{split}",
                {"data": {"name": "uci/boston", "split": split}, "method": {"name": "laplace", "search": search}},
                {"rmse": 3.0 + split},
            )
    frame = build_table(tmp_path, metrics=["rmse"]).frame.set_index("method")
    assert sorted(frame.index) == [
        "laplace search.marglik.noise=False search.marglik.prior=default",
        "laplace search.marglik.noise=default search.marglik.prior=scalar",
    ]
    assert set(frame["n_runs"]) == {2}


def test_a_paper_column_splits_by_setting_and_keeps_its_paper_value(tmp_path: Path) -> None:
    for rank in (1, 5):
        for split in (0, 1):
            _fake_run(
                tmp_path,
                f"L{rank}s{split}",
                {
                    "data": {"name": "uci/boston", "split": split},
                    "method": {"name": "slang", "rank": rank},
                    "paper_table": "slang_table2",
                },
                {"rmse": 3.0 + rank, "test_ll": -2.5},
            )
    frame = build_table(tmp_path, metrics=["rmse"]).frame.set_index("method")
    assert sorted(frame.index) == ["slang rank=1", "slang rank=5"]
    assert (frame["n_runs"] == 2).all()
    assert (frame["paper_rmse"] == get_paper_table("slang_table2").lookup("boston", "slang", "rmse").value).all()


def test_values_a_grid_search_chose_per_split_do_not_split_a_row(tmp_path: Path) -> None:
    # Gal & Ghahramani's protocol picks a dropout rate and tau per split: one dropout row, not one per rate
    grids = {"dropout": {"method.dropout_rate": "dropout_rates.txt", "noise_precision": "tau_values.txt"}}
    for split, (rate, tau) in enumerate([(0.005, 0.1), (0.01, 0.2), (0.005, 0.2)]):
        _fake_run(
            tmp_path,
            f"g{split}",
            {
                "data": {"name": "uci/boston", "split": split},
                "method": {"name": "dropout", "dropout_rate": rate},
                "noise_precision": tau,
                "search": {"grids": grids},
            },
            {"rmse": 3.0},
        )
    frame = build_table(tmp_path, metrics=["rmse"]).frame
    assert list(frame["method"]) == ["dropout"] and list(frame["n_runs"]) == [3]


def test_values_a_search_chose_per_split_do_not_split_a_row(tmp_path: Path) -> None:
    # a stacked search (tune=uci) picks noise_precision per split between the bounds of search.params
    for split, noise in enumerate([0.05, 0.08, 0.11]):
        _fake_run(
            tmp_path,
            f"t{split}",
            {
                "data": {"name": "uci/boston", "split": split},
                "method": {"name": "bbb"},
                "noise_precision": noise,
                "search": {"params": {"noise_precision": [0.04, 0.2]}},
            },
            {"rmse": 3.0},
        )
    frame = build_table(tmp_path, metrics=["rmse"]).frame
    assert list(frame["method"]) == ["bbb"] and list(frame["n_runs"]) == [3]

"""`bdl-bench reproduce`: discovering experiments, expanding their sweep, tuning then testing, the
agreement column, and refusing a results folder that mixes config versions."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from bdl_bench.errors import ResultsError
from bdl_bench.orchestration.reproduce import (
    _expand,
    agreement,
    agreement_line,
    finished_line,
    main,
    make_plan,
    markdown,
)
from bdl_bench.report import frobenius, ktied
from bdl_bench.report.figures import draw_figure
from bdl_bench.report.frobenius import LAYER_CURVATURE_DIR, run_block, run_layer_curvature
from bdl_bench.report.information_form import spectrum_summary
from bdl_bench.report.paper import PaperValue
from bdl_bench.results import code_version, read_config, read_csv_exact


def test_unknown_experiment_lists_the_available_ones() -> None:
    with pytest.raises(SystemExit, match=r"unknown experiment 'slang_table9'; available: .*slang_table1, slang_table2"):
        main(["slang_table9"])


def test_plan_expands_the_sweep_and_drops_splits_a_dataset_lacks() -> None:
    plan = make_plan(
        "slang_table2", ["method=bbb", "data=uci/yacht,uci/protein", "data.split=range(6)"], quick=False, tune=True
    )
    assert plan.keys == ["method", "data", "data.split"]
    assert len(plan.jobs) == 6 + 5  # protein has 5 splits
    assert ["method=bbb", "data=uci/protein", "data.split=4"] in plan.jobs
    # slang_table2's tuning is a stacked search inside each job (bdl_bench/orchestration/search.py)
    assert plan.tuned and "tune=slang_table2" in plan.fixed
    # a job's folder is Hydra's name for its overrides, less the bookkeeping keys (experiment, tune)
    assert (
        plan.job_folder(["method=bbb", "data=uci/protein", "data.split=4"])
        == "data.split=4,data=uci/protein,method=bbb"
    )
    fixed = make_plan("slang_table2", ["method=bbb", "data=uci/yacht"], quick=False, tune=False)
    assert not fixed.tuned and not any(o.startswith("tune=") for o in fixed.fixed)
    quick = make_plan("slang_table2", ["method=bbb,dropout", "data=uci/yacht"], quick=True, tune=False)
    assert len(quick.jobs) == 2 * 2 and not quick.tuned
    assert "trainer.n_epochs=3" in quick.fixed and quick.sweep_dir.name == "slang_table2_quick"


def test_glob_over_a_config_group_matches_nested_options() -> None:
    assert _expand("variant", "glob(slang_table1/mf_*)") == [
        "slang_table1/mf_ef",
        "slang_table1/mf_exact",
        "slang_table1/mf_hess",
    ]
    assert _expand("data.split", "range(3)") == ["0", "1", "2"]


def test_agreement_uses_two_standard_errors_or_the_stated_tolerance() -> None:
    frame = pd.DataFrame(
        {
            "dataset": ["boston", "boston"],
            "method": ["bbb", "map"],
            "n_runs": [20, 20],
            "rmse": [3.0, 3.0],
            "rmse_se": [0.1, 0.1],
            "paper_rmse": [3.43, math.nan],
            "paper_rmse_se": [0.2, math.nan],
            "within_2se_rmse": [True, math.nan],
        }
    )
    assert list(agreement(frame, None)["agrees_rmse"]) == [True, None]
    strict = agreement(frame, {"rmse": 0.1})
    assert list(strict["agrees_rmse"]) == [False, None]
    text = markdown(strict, {"rmse": 0.1})
    assert "| boston | bbb | 20 | 3.000 ± 0.100 | 3.430 ± 0.200 | NO |" in text
    assert "| boston | map | 20 | 3.000 ± 0.100 | – | – |" in text and "rmse: |ours − paper| ≤ 0.1" in text
    # a percentage is relative to the paper's value: |3.0 - 3.43| = 0.43 is 12.5 % of 3.43
    assert list(agreement(frame, {"rmse": "13%"})["agrees_rmse"]) == [True, None]
    assert list(agreement(frame, {"rmse": "12%"})["agrees_rmse"]) == [False, None]
    assert "rmse: |ours − paper| ≤ 2% of |paper| + h" in markdown(agreement(frame, {"rmse": "2%"}), {"rmse": "2%"})
    assert "half a unit in the last printed digit" in text  # the table states its rounding rule
    # a tolerance widens by the paper value's rounding where it is known: 0.43 > 0.42, but ≤ 0.42 + 0.05
    rounded = frame.assign(paper_rmse_rounding=[0.05, math.nan])
    assert list(agreement(rounded, {"rmse": 0.42})["agrees_rmse"]) == [True, None]
    assert list(agreement(frame, {"rmse": 0.42})["agrees_rmse"]) == [False, None]
    with pytest.raises(ValueError, match="percentage"):
        agreement(frame, {"rmse": "two"})


def test_an_agreement_a_zero_would_also_have_is_marked_weak() -> None:
    # 2-tied SNR at step 5000 (ktied_fig6_snr): ours 2,000 ± 3,000 over three seeds "agreed" with the paper's 4
    frame = pd.DataFrame(
        {
            "dataset": ["mnist"] * 3,
            "method": ["2_tied", "1_tied", "full_hess"],
            "n_runs": [3, 3, 20],
            "snr": [2000.0, 4.1, 0.0001],
            "snr_se": [3000.0, 0.2, 0.0001],
            "paper_snr": [4.0, 4.0, 0.0],  # the third: a printed 0.00, informative whatever our band
            "paper_snr_se": [0.5, 0.5, math.nan],
            "paper_snr_rounding": [0.05, 0.05, 0.005],
        }
    )
    values = [PaperValue(4.0, 0.5, 0.05, 0.05), PaperValue(4.0, 0.5, 0.05, 0.05), PaperValue(0.0, None, 0.005)]
    frame["within_2se_snr"] = [abs(o - v.value) <= v.band(se) for o, v, se in zip(frame.snr, values, frame.snr_se)]
    frame["weak_snr"] = [v.weak(se) for v, se in zip(values, frame.snr_se)]
    judged = agreement(frame, None)
    assert list(judged["agrees_snr"]) == [True, True, True]
    assert list(judged["weak_snr"]) == [True, False, False]
    assert "| 2000.000 ± 3000.000 | 4.000 ± 0.500 | yes (weak) |" in markdown(judged, None)
    assert "a 0 would have agreed too" in markdown(judged, None)
    assert agreement_line(judged) == "3 of 3 cells agree with the paper (1 of them weakly: a 0 would have agreed too)."
    # a stated tolerance wider than the paper's value is weak too; a disagreeing cell never is
    assert list(agreement(frame, {"snr": 5.0})["weak_snr"]) == [False, True, False]
    assert agreement_line(agreement(frame, {"snr": 5.0})) == (
        "2 of 3 cells agree with the paper (1 of them weakly: a 0 would have agreed too)."
    )
    assert agreement_line(frame.drop(columns=["paper_snr"])) is None


def test_a_table_from_part_of_a_sweep_names_the_missing_settings() -> None:
    jobs = [
        [f"data.split={i}", "data=libsvm/usps_3vs5", f"variant=slang_table1/{v}"]
        for v in ("L1", "L10")
        for i in range(3)
    ]
    jobs.append(["data.split=0", "data=libsvm/a1a", "variant=slang_table1/L1"])
    assert finished_line(jobs, [True] * 7) == "7 of 7 runs"
    line = finished_line(jobs, [True, True, True, False, True, False, False])
    assert line == (
        "4 of 7 runs; not in this table: data=libsvm/usps_3vs5,variant=slang_table1/L10 (2 runs); "
        "data=libsvm/a1a,variant=slang_table1/L1 (1 run)"
    )
    # a piece of a sweep over seeds: the seeds not yet run, not one entry per run
    seeds = [[f"variant={v}", f"trainer.seed={s}"] for v in ("L8", "bbb") for s in range(1, 4)]
    pieces = [s.endswith("=1") for _, s in seeds]
    assert finished_line(seeds, pieces) == "2 of 6 runs; not in this table: trainer.seed=2, 3 (4 runs)"


@pytest.mark.slow
def test_quick_reproduce_tunes_tests_tables_and_refuses_another_config_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweeps run in this process
    args = ["slang_table2", "method=bbb", "data=uci/boston", "data.split=0", "--quick", "--jobs=1"]
    args += ["hydra/launcher=basic", f"results_root={tmp_path}"]
    main(args)
    out = capsys.readouterr().out
    assert "| boston | bbb | 1 |" in out and "cells agree with the paper" in out
    runs = tmp_path / "slang_table2_quick"
    report = (runs / "reproduce.md").read_text()
    assert report.startswith("# slang_table2 (--quick")
    # the header says where the table came from: the command, the code version, the date
    assert "command: `bdl-bench reproduce slang_table2 method=bbb data=uci/boston" in report
    assert f"code: `{code_version()}`" in report and "date: `20" in report and "finished: `1 of 1 runs`" in report
    csv_text = (runs / "reproduce.csv").read_text()
    assert csv_text.startswith("# command: bdl-bench reproduce slang_table2")
    assert "agrees_rmse" in pd.read_csv(runs / "reproduce.csv", comment="#").columns
    search = "search.n_guided=2,search.n_random=2,search.round_size=2"
    run_dir = runs / f"data.split=0,data=uci/boston,method=bbb,{search},trainer.n_epochs=3"
    trials = read_csv_exact(run_dir / "search.csv")  # the stacked search's 4 trials, the best marked
    assert len(trials) == 4 and trials["best"].sum() == 1
    best = trials[trials["best"]].iloc[0]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["noise_precision"] == best["noise_precision"] and config["data"]["val_fraction"] == 0.0

    # --no-run: a table from the finished part of a wider sweep, trains nothing and names what it leaves out
    main([*[a.replace("data.split=0", "data.split=0,1") for a in args], "--no-run"])
    out = capsys.readouterr().out
    assert "| boston | bbb | 1 |" in out and "1 runs: 1 finished (none run now), 0 failed" in out
    assert not any(runs.glob("data.split=1,*"))
    assert (
        "finished: `1 of 2 runs; not in this table: method=bbb,data=uci/boston (1 run)`"
        in (runs / "reproduce.md").read_text()
    )

    # another piece of the same experiment in the same folder (split 2) is not in this sweep's table
    main([a.replace("data.split=0", "data.split=2") for a in args])
    assert "| boston | bbb | 1 |" in capsys.readouterr().out
    main(args)
    out = capsys.readouterr().out
    assert "| boston | bbb | 1 |" in out and "0 ran, 1 skipped" in out  # split 0's run alone, not split 2's beside it
    assert "| boston | bbb | 1 |" in (runs / "reproduce.md").read_text()
    # a piece run by another code version (committed from another machine): the header says so
    record = runs / f"data.split=2,data=uci/boston,method=bbb,{search},trainer.n_epochs=3" / "run.json"
    record.write_text(record.read_text().replace(code_version(), "0123abc"))
    main(args)
    assert (
        "runs: `the runs below" in (runs / "reproduce.md").read_text() and "0123abc: 1 runs" in capsys.readouterr().out
    )

    # a finished run outside this sweep whose config today's code no longer reproduces
    foreign = runs / f"data.split=1,data=uci/boston,method=bbb,{search},trainer.n_epochs=3"
    shutil.copytree(run_dir, foreign)
    overrides = (foreign / ".hydra" / "overrides.yaml").read_text().replace("data.split=0", "data.split=1")
    (foreign / ".hydra" / "overrides.yaml").write_text(overrides)
    config = (foreign / "config.yaml").read_text().replace("split: 0", "split: 1")
    (foreign / "config.yaml").write_text(config.replace("n_test_mc_samples: 20", "n_test_mc_samples: 21"))
    with pytest.raises(SystemExit, match=r"holds 1 run\(s\) of another config version, so no table(.|\n)*config hash"):
        main(args)
    assert "0 ran, 1 skipped" in capsys.readouterr().out  # the sweep's own run was reused, not re-run


def test_quick_reproduce_of_a_figure_draws_it_beside_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slang_fig4_bnn's ``figures`` entry: reproduce writes fig4_right.png and shows it in reproduce.md."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweeps run in this process
    # the basic launcher: joblib's, even with one job, runs in this process and leaves its Hydra job config set,
    # which a later stacked job in this process would take for its own (bdl_bench.orchestration.sweep.member_dirs)
    args = ["slang_fig4_bnn", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    args += ["data=libsvm/breast_cancer", "trainer.seed=1"]  # one of the authors' 10 seeds
    main([*args, "variant=slang_fig4_bnn/slang_L8,slang_fig4_bnn/bbb"])
    folder = tmp_path / "slang_fig4_bnn_quick"
    # the authors plot the joint test log-loss: every evaluated epoch records it
    histories = [pd.read_csv(h) for h in folder.rglob("history.csv")]
    assert len(histories) == 2 and all(h["test/test_ll_joint"].notna().all() for h in histories)
    png = folder / "fig4_right.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (folder / "reproduce.md").read_text()
    assert "![fig4_right](fig4_right.png)" in report
    assert "Protocol: the authors' BNN setup" in report  # the experiment's protocol line, above the table
    # the paper prints no numbers for Fig. 4: no agreement rule under a table that has no agreement column
    assert "no agreement column" in report and "agrees: |ours" not in report


def test_a_figure_without_its_runs_is_skipped_with_the_reason(tmp_path: Path) -> None:
    from bdl_bench.report.figures import draw_figures

    drawn, skipped = draw_figures([{"name": "fig1", "kind": "covariance", "dataset": "usps_3vs5"}], tmp_path)
    assert drawn == [] and skipped[0].startswith("fig1: no finished runs")
    drawn, skipped = draw_figures([{"name": "fig5", "kind": "frobenius"}], tmp_path)
    assert drawn == [] and skipped == [
        f"fig5: no finished map run below {tmp_path} (the figure is computed at its parameters)"
    ]
    with pytest.raises(ValueError, match="needs a name and a kind"):
        draw_figures([{"name": "x", "kind": "histogram"}], tmp_path)


def test_quick_reproduce_of_def_toy_draws_fig4_from_the_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """def_toy: every run saves predictive.npz, reproduce draws def_toy.png (DEF Fig. 4) from them, and
    full-rank and rank-1 DEF are separate table rows (rank null vs 1)."""
    import numpy as np

    from bdl_bench.studies.def_toy import plot_runs

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweeps run in this process
    args = ["def_toy", "--quick", "--jobs", "1", f"results_root={tmp_path}"]
    main([*args, "variant=def_toy/map,def_toy/def,def_toy/def_rank1"])
    folder = tmp_path / "def_toy_quick"
    assert (folder / "def_toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![def_toy](def_toy.png)" in (folder / "reproduce.md").read_text()
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert sorted(table["method"]) == ["laplace rank=1", "laplace rank=null", "map"]
    assert (table["n_runs"] == 1).all()
    stds = {}
    for npz in folder.rglob("predictive.npz"):
        arrays = np.load(npz)
        assert arrays["f_mean"].shape == arrays["f_std"].shape == arrays["y_test"].shape == (200,)
        assert float(arrays["noise_std"]) == pytest.approx(3.0, rel=1e-3)  # noise precision 0.1111 = 1/3^2
        stds[npz.parent.name] = arrays["f_std"]
    assert len(stds) == 3
    assert all((std == 0).all() == ("map" in name) for name, std in stds.items())  # only the MAP has no spread
    only, _ = plot_runs(folder, tmp_path / "only_map.png", ["map"])
    assert only.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_map_trains_the_map_once_and_fits_the_post_hoc_column_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An experiment's ``shared_map``: the ``to`` column is not trained but fitted on the ``from`` run's MAP (its
    ``method.map_dir``), which reproduce runs first even when the sweep leaves it out; the table holds the sweep's
    own column only."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweeps run in this process
    shared = "+shared_map={from:def_toy/map,to:[def_toy/def]}"
    main(
        [
            "def_toy",
            "--quick",
            "--jobs",
            "1",
            "hydra/launcher=basic",
            f"results_root={tmp_path}",
            shared,
            "variant=def_toy/def",
        ]
    )
    folder = tmp_path / "def_toy_quick"
    map_run, def_run = (
        folder / "trainer.n_epochs=3,variant=def_toy/map",
        folder / "trainer.n_epochs=3,variant=def_toy/def",
    )
    config = yaml.safe_load((def_run / "config.yaml").read_text())
    assert config["method"]["map_dir"] == str(map_run)
    assert len(pd.read_csv(def_run / "history.csv")) == 1  # no training epochs: the posterior's one row
    map_theta = torch.load(map_run / "params.pt", weights_only=True)["theta"]
    assert torch.equal(torch.load(def_run / "params.pt", weights_only=True)["theta"], map_theta)  # the mean: the MAP
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["method"]) == ["laplace"]


def test_quick_reproduce_of_slang_appf1_draws_the_three_columns_in_original_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slang_appF1 (SLANG App. F.1 at the authors' setup): BBB and SLANG L = 1, 5 on the unstandardised toy, each
    saving its predictive, drawn in one figure whose table holds each column's spread."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    main(["slang_appF1", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"])
    folder = tmp_path / "slang_appF1_quick"
    report = (folder / "reproduce.md").read_text()
    assert "![slang_appF1](slang_appF1.png)" in report and "| SLANG (L = 5) |" in report
    for run in ("bbb", "slang_L1", "slang_L5"):
        config = read_config(folder / f"trainer.n_epochs=3,variant=slang_appF1/{run}" / "config.yaml")
        assert config["data"]["standardise"] is False and config["data"]["n_train"] == 30
        arrays = np.load(folder / f"trainer.n_epochs=3,variant=slang_appF1/{run}" / "predictive.npz")
        assert float(arrays["noise_std"]) == pytest.approx(0.1**-0.5)  # noise precision 0.1, original units
    assert (
        read_config(folder / "trainer.n_epochs=3,variant=slang_appF1/slang_L1/config.yaml")["method"]["beta_decay"]
        == 0.25
    )


def test_quick_reproduce_of_def_frobenius_writes_fig5_and_its_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """def_frobenius: one MAP run, then DEF Fig. 5 computed at its parameters (figure kind ``frobenius``); the
    figure's numbers are reproduce.md's first table and all of reproduce.csv, with the criterion under them."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    main(["def_frobenius", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"])
    folder = tmp_path / "def_frobenius_quick"
    assert (folder / "def_frobenius.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in folder.rglob("params.pt")] == ["params.pt"]  # the one MAP run it is computed from
    report = (folder / "reproduce.md").read_text()
    assert report.index("def_frobenius (the figure's numbers)") < report.index("The runs the figure is computed from")
    assert "Agreement with the paper: the paper prints no numbers for Fig. 5" in report
    assert "| DEF | 14 | 14 | 1 | 0.0000 |" in report and "![def_frobenius](def_frobenius.png)" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["method"].iloc[:3]) == ["Diag", "KFAC", "EFB"]
    defs = table[table["method"] == "DEF"]
    assert list(defs["rank"]) == list(range(1, 15))  # the first layer, 1 -> 7 with biases: 14 parameters
    assert (defs["kept"] >= defs["rank"]).all() and (table["n_runs"] == 1).all()
    assert (defs["err_diag"] < 1e-10).all()  # Prop. 1: DEF's diagonal is exact at every K
    efb = table[table["method"] == "EFB"].iloc[0]
    assert defs["err_offdiag"].iloc[-1] == pytest.approx(efb["err_offdiag"])  # full-rank DEF: EFB's off-diagonal
    diag = table[table["method"] == "Diag"].iloc[0]
    assert diag["err_diag"] == 0 and diag["err_offdiag"] == pytest.approx(1.0)  # the exact diagonal, no off-diagonal

    # DEF Fig. 1 (figure kind information_form) at the same MAP: its block, streamed in minibatches of 7 rows,
    # is the single-batch block of Fig. 5; the spectrum counts and DEF's exact diagonal follow from it.
    run_dir = next(folder.rglob("params.pt")).parent
    block, _ = run_block(run_dir)
    streamed, factors, _, n_examples = run_layer_curvature(run_dir, batch_size=7)
    torch.testing.assert_close(streamed, block, rtol=1e-10, atol=1e-12)
    # Kept in the run folder and read back without a pass; other settings compute (and keep) their own.
    with monkeypatch.context() as m:
        m.setattr(frobenius, "iter_pseudo_grads", lambda *a, **k: pytest.fail("recomputed a kept block"))
        again, kept, _, _ = run_layer_curvature(run_dir, batch_size=7)
    assert torch.equal(again, streamed) and torch.equal(kept.g_factor, factors.g_factor) and kept.slot == factors.slot
    with monkeypatch.context() as m:  # other package code: computed again
        m.setattr(frobenius, "package_digest", lambda: "edited")
        m.setattr(frobenius, "iter_pseudo_grads", lambda *a, **k: pytest.fail("computed again"))
        with pytest.raises(pytest.fail.Exception, match="computed again"):
            run_layer_curvature(run_dir, batch_size=7)
    fewer, *_ = run_layer_curvature(run_dir, batch_size=7, n_examples=50)
    assert not torch.equal(fewer, streamed)
    assert len(list((run_dir / LAYER_CURVATURE_DIR).glob("*.pt"))) == 3  # run_block's one batch, 7 rows, 50 examples

    def read_only(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:  # a run folder it cannot write to: the result all the same, nothing kept
        m.setattr(frobenius, "atomic_torch_save", read_only)
        unkept, *_ = run_layer_curvature(run_dir, batch_size=7, n_examples=40)
    assert len(list((run_dir / LAYER_CURVATURE_DIR).glob("*.pt"))) == 3
    torch.testing.assert_close(run_layer_curvature(run_dir, batch_size=7, n_examples=40)[0], unkept, rtol=0, atol=0)
    spec = {"name": "fig1", "kind": "information_form", "rank": 3, "dataset_scale": 18.0, "prior_precision": 1.0}
    drawn = draw_figure({**spec, "batch_size": 7}, folder, folder)
    assert drawn.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = spectrum_summary(torch.linalg.eigvalsh(block))
    assert summary["n_params"] == 14 and 1 <= summary["n_trace"] <= 14
    fig1 = drawn.table
    assert list(fig1["method"]) == ["Diag", "KFAC", "EFB", "DEF"] and (fig1["n_trace"] == summary["n_trace"]).all()
    assert fig1["err_diag"].iloc[-1] < 1e-10 and fig1["kept"].iloc[-1] >= 3
    assert f"| 14 | {n_examples} | {summary['n_small']} (" in drawn.table_markdown


SHARED_MNIST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"
needs_mnist = pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="../shared/data/mnist is not beside the checkout")
TINY_MNIST = ["model.hidden=[8,8]", "trainer.n_test_mc_samples=5", "trainer.n_elbo_mc_samples=2"]


@pytest.mark.slow
@needs_mnist
def test_quick_reproduce_of_ktied_table2_writes_fig3_and_the_rank_k_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ktied_table2: one unannealed GMFVI run, then Fig. 3's spectra (PNG and numbers) and Table 2's rank-k rows
    beside the paper's, over the run's trainer.n_test_mc_samples weight samples."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["ktied_table2", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    main([*args, *TINY_MNIST, f"data.mirror={SHARED_MNIST}"])
    folder = tmp_path / "ktied_table2_quick"
    assert (folder / "fig3_spectra.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (folder / "reproduce.md").read_text()
    assert report.index("fig3_spectra (the figure's numbers)") < report.index("table2_low_rank (the figure's")
    assert "| dense 2 | 8 x 8 | stds |" in report and "![fig3_spectra](fig3_spectra.png)" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    rows = table[table["figure"] == "table2_low_rank"].set_index("method")
    assert list(rows.index) == ["mean_field", *(f"mean_field, rank-{k} std" for k in (1, 2, 3))]
    assert (rows["n_samples"] == 5).all() and rows["paper_neg_elbo"].tolist() == [0.431, 3.41, 0.456, 0.450]
    # rank k keeps k(m + n) std numbers per weight matrix: 784-8-8-10 has (8+784) + (8+8) + (10+8) = 826 per k
    assert rows["n_variational_params"].iloc[1:].diff().dropna().tolist() == [826.0, 826.0]
    assert rows["agrees_nll"].notna().all() and (rows["neg_elbo"] > rows["nll"]).all()  # -ELBO adds KL / N
    spectra = table[table["figure"] == "fig3_spectra"]
    assert set(spectra["parameter"]) == {"std", "mean"} and len(spectra) == 6  # 3 layers x (std, mean)
    config = yaml.safe_load(next(folder.rglob("config.yaml")).read_text())
    assert config["method"]["kl_annealing_steps"] == 0


@pytest.mark.slow
@needs_mnist
def test_quick_reproduce_of_ktied_fig6_records_the_paper_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ktied_fig6: steps.csv every 1000 steps (3 quick epochs of 391 batches reach step 1000), Fig. 6 left per run
    and Fig. 6 right at step 1000 beside the paper's, and the curves' PNG."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["ktied_fig6", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    columns = ["variant=ktied_fig6/mean_field,ktied_fig6/2_tied", "trainer.seed=0"]
    main([*args, *TINY_MNIST, f"data.mirror={SHARED_MNIST}", *columns])
    folder = tmp_path / "ktied_fig6_quick"
    assert (folder / "fig6_right.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [pd.read_csv(p) for p in folder.rglob("steps.csv")]
    assert len(steps) == 2 and all(list(s["step"]) == [1000] for s in steps)
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    right = table[table["figure"] == "fig6_right"].set_index("method")
    assert sorted(right.index) == ["2_tied", "mean_field"] and (right["step"] == 1000).all()
    assert right.loc["mean_field", "paper_snr"] == 4.13 and right.loc["2_tied", "paper_val_neg_elbo"] == 42.74
    assert (right["snr"] >= 1.0).all() and (right["snr_median"] >= 1.0).all()  # E[g²]/Var[g] >= 1
    left = table[table["figure"] == "fig6_left"].set_index("method")
    assert left.loc["mean_field", "paper_neg_elbo"] == 0.501 and left.loc["2_tied", "paper_nll"] == 0.129
    # variational parameters: mean-field 2 x (all weights and biases), 2-tied the means, bias stds and 2(m + n)
    d, biases = 784 * 8 + 8 * 8 + 8 * 10 + 8 + 8 + 10, 8 + 8 + 10
    assert left.loc["mean_field", "n_variational_params"] == 2 * d
    assert left.loc["2_tied", "n_variational_params"] == d + biases + 2 * (8 + 784 + 8 + 8 + 10 + 8)
    assert list(left["paper_n_variational_params_k"]) == [957, 484]  # the paper's 784-400-400-10, not this 8-8 net
    # the committed pieces of a long reproduction keep no weights: the rows come back from weight_samples.csv
    computed, _ = ktied.weight_samples(folder, [], "fig6_left")
    for posterior in folder.rglob("posterior.pt"):
        posterior.unlink()
    pd.testing.assert_frame_equal(ktied.weight_samples(folder, [], "fig6_left")[0], computed)
    with pytest.raises(ResultsError, match="no posterior.pt and no weight_samples.csv of ranks \\[\\], 7 samples"):
        ktied.weight_samples(folder, [], "fig6_left", samples=7)


@pytest.mark.slow
@needs_mnist
def test_ktied_fig6_snr_runs_are_the_first_steps_of_ktied_fig6s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ktied_fig6_snr stops ktied_fig6's runs early on their own KL schedule: what it records up to its last epoch
    equals the longer run's record, bit for bit on one thread (here 3 against 4 epochs, at step 1000)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweeps run in this process
    common = ["--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}", *TINY_MNIST]
    common += [f"data.mirror={SHARED_MNIST}", "variant=ktied_fig6/mean_field", "trainer.seed=0"]
    main(["ktied_fig6_snr", "--quick", *common])
    short = tmp_path / "ktied_fig6_snr_quick"
    assert (short / "fig6_right.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    right = pd.read_csv(short / "reproduce.csv", comment="#").query("figure == 'fig6_right'")
    assert right["step"].tolist() == [1000] and right["paper_snr"].tolist() == [4.13]
    (shorter,) = short.rglob("steps.csv")
    config = yaml.safe_load((shorter.parent / "config.yaml").read_text())
    assert config["method"]["kl_annealing_steps"] == 300 * 391  # ktied_fig6's schedule
    main(["ktied_fig6", *common, "trainer.n_epochs=4", "method.kl_annealing_steps=117300"])
    (longer,) = (tmp_path / "ktied_fig6").rglob("steps.csv")
    pd.testing.assert_frame_equal(pd.read_csv(shorter), pd.read_csv(longer))


def test_a_tolerance_keyed_by_a_name_the_paper_table_lacks_is_refused() -> None:
    """slang_table1 once keyed its 2 % criterion by our metric keys (elbo_no_bias_logdet, nll), which the
    agreement never looked up: the two-SE rule applied instead, silently."""
    from bdl_bench.errors import ConfigError
    from bdl_bench.orchestration.reproduce import check_tolerance

    with pytest.raises(
        ConfigError, match="elbo_no_bias_logdet is not a metric of the paper table 'slang_table1'.*neg_elbo_per_example"
    ):
        check_tolerance({"elbo_no_bias_logdet": "2%"}, "slang_table1")
    check_tolerance({"neg_elbo_per_example": "2%", "test_nll": "2%"}, "slang_table1")
    for path in sorted(
        (Path(__file__).parents[1] / "conf" / "experiment").glob("*.yaml")
    ):  # every experiment's stated criterion applies
        config = yaml.safe_load(path.read_text()) or {}
        if config.get("tolerance"):
            check_tolerance(config["tolerance"], config.get("paper_table"))


@pytest.mark.slow
@needs_mnist
def test_quick_reproduce_of_def_table1_writes_table1_figs_1_6_10_and_table2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """def_table1 end to end on a tiny budget: a 2-4-16 LeNet on 1,000 training images (the other 59,000 held out),
    a 2-point Laplace search on 200 validation images, 2 test samples: the table beside the paper's MNIST column,
    Fig. 1 from the MAP, Fig. 6 from the test passes, Fig. 10 from the searches and Table 2 from the DEF run."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["def_table1", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    args += [f"data.mirror={SHARED_MNIST.parent}", "data.n_val=59000", "model.channels=[2,4]", "model.hidden=16"]
    args += ["laplace_search.dataset_scale=[1000]", "laplace_search.prior_precision.logspace=[2,4,2]"]
    args += ["laplace_search.max_val_examples=200", "laplace_search.n_samples=2"]
    args += ["trainer.n_test_mc_samples=2", "trainer.test_mc_prefixes=[1]"]
    main([*args, "variant=def_table1/nn,def_table1/diag,def_table1/kfac,def_table1/def"])
    folder = tmp_path / "def_table1_quick"
    for png in ("fig1_information_form", "fig6_ood_entropy", "fig10_laplace_search"):
        assert (folder / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    report = (folder / "reproduce.md").read_text()
    assert report.startswith("# def_table1 (--quick") and "finished: `4 of 4 runs`" in report
    for figure in ("fig1_information_form", "table2_def_ranks", "test_sample_count"):
        assert f"{figure} (the figure's numbers)" in report, figure
    # Fig. 1: the first conv layer, 2 filters of 5 x 5 with biases; DEF at K = 200 keeps them all
    assert "| 52 | 1000 |" in report and "| DEF | 200 | 52 | 1 | 0.0000 |" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["method"]) == ["def", "diag", "kfac", "nn"] and table["paper_accuracy"].notna().all()
    assert "| CNN-1 | 200 | 50 | 2 x 26 | 2 x 26 | 52 |" in report  # Table 2: the first layer, kept whole
    assert "| diag | 2 | 1000 |" in report and "| kfac | 2 | 1000 |" in report  # Fig. 10: both 2-point searches
    assert "| mnist | def | 1 | 1 |" in report and "| mnist | def | 2 | 1 |" in report  # the effect of the count
    searched = [pd.read_csv(p) for p in folder.rglob("laplace_search.csv")]
    assert len(searched) == 3 and all(len(s) == 2 and s["chosen"].sum() == 1 for s in searched)


@pytest.mark.slow
@needs_mnist
def test_quick_reproduce_of_slang_table3_puts_bbb_and_slang_beside_the_paper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slang_table3 end to end on a tiny budget (a 784-8-8-10 MLP, 3 epochs, 5 test samples): the test error of
    BBB and SLANG L = 1 beside the paper's column, each with the setting it ran at."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["slang_table3", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    main([*args, *TINY_MNIST, f"data.mirror={SHARED_MNIST}", "variant=slang_table3/bbb,slang_table3/slang_L1"])
    folder = tmp_path / "slang_table3_quick"
    report = (folder / "reproduce.md").read_text()
    assert report.startswith("# slang_table3 (--quick") and "finished: `2 of 2 runs`" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["method"]) == ["bbb", "slang_L1"] and list(table["paper_test_error_percent"]) == [1.82, 2.0]
    assert table["test_error_percent"].between(0, 100).all() and "agrees_test_error_percent" in table
    # the setting each column ran at, as the table names the paper's choice on validation
    assert "method.decay=0.6" in table["chosen_on_validation"].iloc[1] and "prior_precision=54.598" in report


def test_a_sweep_that_cannot_compose_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """An override the MAP column's method lacks fails that sweep before any run folder exists: reproduce says
    so with Hydra's reason (it used to end with only "no run of this sweep finished")."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["def_table1", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    with pytest.raises(SystemExit, match="no run of this sweep finished"):
        main([*args, "variant=def_table1/nn,def_table1/def", "method.curvature_cache_mib=64"])
    err = capsys.readouterr().err
    assert "the sweep variant=def_table1/nn stopped" in err and "method.curvature_cache_mib" in err
    # the same override on the MAP column alone fails the plan itself: one line, no traceback
    with pytest.raises(SystemExit, match=r"^bdl-bench: Could not override 'method.curvature_cache_mib'"):
        main([*args, "variant=def_table1/nn", "method.curvature_cache_mib=64"])


@pytest.mark.slow
def test_quick_reproduce_of_slang_table1_gaps_to_the_exact_gaussian_and_draws_figs_4_and_7(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slang_table1 end to end on a tiny budget (australian, 2 stacked splits, 3 epochs, three columns): each
    column as its paired gap to the exact full Gaussian beside the paper's, Fig. 4 left from the histories and
    Fig. 7's australian panel from the posteriors; the figures of sets not run are skipped with the reason."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    args = ["slang_table1", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    main(
        [*args, "data=libsvm/australian", "variant=slang_table1/mf_exact,slang_table1/slang_L1,slang_table1/full_exact"]
    )
    folder = tmp_path / "slang_table1_quick"
    for png in ("fig4_left", "fig7_australian"):
        assert (folder / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    report = (folder / "reproduce.md").read_text()
    assert "finished: `6 of 6 runs`" in report and "difference to full_exact on the same split" in report
    assert "| full_exact | 0.000 | 0.000 | 1.000 | 1.000 |" in report  # Fig. 7's reference against itself
    assert "Figure not drawn: fig1: no runs with posterior.pt for dataset 'usps_3vs5'" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#").set_index("method")
    assert list(table.index) == ["full_exact", "mf_exact", "slang_L1"] and (table["n_runs"] == 2).all()
    assert table.loc["full_exact", "neg_elbo_per_example"] == 0 and table.loc["full_exact", "sym_kl_vs_full_exact"] == 0
    assert table.loc["mf_exact", "paper_neg_elbo_per_example"] == pytest.approx(0.034)  # the paper's gap
    assert (table.loc[["mf_exact", "slang_L1"], "neg_elbo_per_example"] > 0).all()  # no Gaussian beats the exact one


def test_a_restricted_piece_keeps_the_fuller_table_it_would_overwrite(tmp_path: Path) -> None:
    """A piece run on some settings of a sweep (variant=X) beside the whole sweep writes its smaller table; the
    fuller one it replaces is kept as reproduce.previous.md/.csv, and a fuller new table keeps nothing."""
    from bdl_bench.orchestration.reproduce import write_report

    frame = pd.DataFrame({"method": ["a"]})
    assert write_report(tmp_path, "# t", {"finished": "4 of 7 runs; not in this table: x"}, "full", frame) is None
    kept = write_report(tmp_path, "# t", {"finished": "1 of 1 runs"}, "piece", frame)
    assert kept == tmp_path / "reproduce.previous.md" and "full" in kept.read_text()
    assert "4 of 7" in (tmp_path / "reproduce.previous.csv").read_text()
    assert "piece" in (tmp_path / "reproduce.md").read_text()
    assert write_report(tmp_path, "# t", {"finished": "5 of 7 runs"}, "fuller", frame) is None
    assert "full" in (tmp_path / "reproduce.previous.md").read_text()  # the earlier keep stays as it was
    assert write_report(tmp_path, "# t", {"commit": "x"}, "no count", frame) is None  # a benchmark's header

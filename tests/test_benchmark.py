"""``bdl-bench reproduce`` of the benchmark experiments (``ktied_table4``, ``elrg_table1``): ``--quick`` runs end to
end into a results folder, and the tables hold the paper's column. Step times are never asserted (a loaded machine
makes any speed claim flaky): only that the measured values exist, are positive and finite."""

from __future__ import annotations

import ctypes
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from bdl_bench.errors import ConfigError
from bdl_bench.orchestration import allocator
from bdl_bench.orchestration.benchmark import (
    Benchmark,
    elrg_predicted_memory_ratio,
    elrg_predicted_time_ratio,
    ktied_paper_ratios,
    measure,
)
from bdl_bench.orchestration.reproduce import benchmark_experiment
from bdl_bench.orchestration.reproduce import main as reproduce


def _read(folder: Path) -> tuple[str, pd.DataFrame]:
    return (folder / "reproduce.md").read_text(), pd.read_csv(folder / "reproduce.csv", comment="#")


def _positive(values: pd.Series) -> bool:
    return bool(((values > 0) & values.map(math.isfinite)).all())


def test_only_the_benchmark_experiments_take_the_benchmark_path() -> None:
    assert benchmark_experiment("ktied_table4") and benchmark_experiment("elrg_table1")
    assert not benchmark_experiment("slang_table2") and not benchmark_experiment("no_such_experiment")


def test_no_run_is_refused_for_a_benchmark_rather_than_timing_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="ktied_table4 is a benchmark, with no runs to table; drop --no-run"):
        reproduce(["ktied_table4", "--no-run", f"results_root={tmp_path}"])
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_quick_ktied_table4_writes_our_ratios_beside_the_papers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(allocator, "_applied", False)  # as a fresh process: the benchmark must apply it itself
    monkeypatch.delenv(allocator.ENV_SWITCH, raising=False)
    reproduce(["ktied_table4", "--quick", f"results_root={tmp_path}"])
    text, table = _read(tmp_path / "ktied_table4_quick")
    assert text.startswith("# ktied_table4 (--quick")
    glibc = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallopt")
    assert allocator._applied == glibc  # timed as runs run (hydra_app applies it too)
    assert ("malloc kept" if glibc else "malloc system") in text
    for line in ("command: `bdl-bench reproduce ktied_table4 --quick", "code: ", "date: ", "machine: ", "CPU time: "):
        assert line in text
    assert "Google Colab" in text  # the paper's net and machine are not ours
    assert list(table["method"]) == ["point_estimate", "standard_gmfvi", "2_tied_gmfvi"]
    assert set(table["model"]) == {"784-8-10"}
    assert _positive(table["step_ms"]) and _positive(table["ratio_to_point"]) and _positive(table["peak_mem_mib"])
    assert table["ratio_to_point"].iloc[0] == 1.0
    assert table.loc[1, "ratio_to_gmfvi"] == pytest.approx(1.0)
    paper = table.set_index("method")
    assert paper.loc["standard_gmfvi", "paper_ratio_to_point"] == pytest.approx(7.17 / 2.00)
    assert paper.loc["2_tied_gmfvi", "paper_ratio_to_gmfvi"] == pytest.approx(6.14 / 7.17)
    assert paper.loc["2_tied_gmfvi", "paper_step_ms"] == 6.14


@pytest.mark.slow
def test_quick_elrg_table1_sweeps_k_and_width_beside_the_stated_complexity(tmp_path: Path) -> None:
    reproduce(["elrg_table1", "--quick", f"results_root={tmp_path}"])
    text, table = _read(tmp_path / "elrg_table1_quick")
    assert text.startswith("# elrg_table1 (--quick") and "O(K³ + (K+2)·N_in·N_out·|B|)" in text
    assert len(table) == 2 * 3  # widths 8 and 16; mean field, ELRG-VI K=1, ELRG-D-VI K=2
    assert sorted(set(table["width"])) == [8, 16]
    for column in ("step_ms", "time_ratio_to_mf", "flop_ratio_to_mf", "peak_mem_mib", "mem_ratio_to_mf"):
        assert _positive(table[column]), column
    mean_field = table[table["method"] == "mean field (LRT)"]
    assert (mean_field[["time_ratio_to_mf", "paper_time_ratio", "mem_ratio_to_mf"]] == 1.0).all().all()
    low_rank = table.dropna(subset=["K"])
    assert list(low_rank["method"]) == ["ELRG-VI", "ELRG-D-VI"] * 2
    hidden = low_rank["model"].map(lambda m: [int(h) for h in m.split("-")[1:-1]])
    expected = [elrg_predicted_time_ratio(h, int(k), 4) for h, k in zip(hidden, low_rank["K"])]
    assert list(low_rank["paper_time_ratio"]) == pytest.approx(expected)
    assert list(low_rank["paper_mem_ratio"]) == pytest.approx(list((low_rank["K"] + 2) / 2))
    # ELRG-D-VI runs K + 2 = 4 layer-sized paths to mean field's 2 (plus the K x K Gram matrix)
    assert low_rank[low_rank["method"] == "ELRG-D-VI"]["flop_ratio_to_mf"].between(2.0, 2.6).all()


def test_the_stated_complexities_evaluated_over_the_layers() -> None:
    layers = [(784, 100), (100, 10)]
    batch, k = 3, 10
    low_rank = sum(k**3 + (k + 2) * i * o * batch for i, o in layers)
    assert elrg_predicted_time_ratio([100], k, batch) == pytest.approx(
        low_rank / sum(2 * i * o * batch for i, o in layers)
    )
    assert elrg_predicted_time_ratio([100, 100], 0, 1) == pytest.approx(1.0)  # K = 0: mean field's two paths
    assert elrg_predicted_time_ratio([800, 800], 5, 10_000) == pytest.approx(3.5, rel=1e-4)  # K³ vanishes
    assert elrg_predicted_memory_ratio([100, 100], 5, 200) == pytest.approx(3.5)


def test_paper_ratios_carry_delta_method_errors() -> None:
    ratios = ktied_paper_ratios()
    mean, sem, to_point, to_point_se, to_gmfvi, to_gmfvi_se = ratios["2_tied_gmfvi"]
    assert (mean, sem) == (6.14, 0.018)
    assert to_point == pytest.approx(3.07) and to_gmfvi == pytest.approx(0.8563, abs=1e-4)
    assert to_point_se == pytest.approx(3.07 * math.hypot(0.018 / 6.14, 0.0064 / 2.00))
    assert ratios["point_estimate"][3] == 0.0 and ratios["standard_gmfvi"][5] == 0.0


def test_benchmark_block_is_checked_and_quick_replaces_its_keys() -> None:
    node = {"table": "elrg_table1", "methods": ["gmfvi"], "hidden": [[4]], "steps": 50, "quick": {"steps": 2}}
    assert Benchmark.from_config(node, quick=False).steps == 50
    assert Benchmark.from_config(node, quick=True).steps == 2
    with pytest.raises(ConfigError, match="unknown key"):
        Benchmark.from_config({**node, "width": 3}, quick=False)
    with pytest.raises(ConfigError, match="benchmark.table"):
        Benchmark.from_config({**node, "table": "nope"}, quick=False)
    with pytest.raises(ConfigError, match="benchmark.steps"):
        Benchmark.from_config({**node, "steps": 0}, quick=False)
    with pytest.raises(ConfigError, match="hidden missing"):
        Benchmark.from_config({"table": "elrg_table1", "methods": ["gmfvi"]}, quick=False)


def test_an_unknown_method_is_a_config_error_before_any_timing() -> None:
    bench = Benchmark(table="elrg_table1", methods=["gmfvi", "nope:3"], hidden=[[4]], memory=False)
    with pytest.raises(ConfigError, match="benchmark.methods: unknown method 'nope:3'"):
        measure(bench, progress=lambda _: None)


def test_run_refuses_a_benchmark_experiment() -> None:
    from bdl_bench.config_checks import check_config
    from bdl_bench.orchestration.hydra_app import load_config

    with pytest.raises(ConfigError, match="use `bdl-bench reproduce elrg_table1`"):
        check_config(load_config(["experiment=elrg_table1"], multirun=False))

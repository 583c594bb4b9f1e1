"""DEF Fig. 9 (figure kind ``hessian_blocks``): the zero-information count of a layer's information block, checked
against the ReLU units that no training input activates, and the quick reproduction end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from bdl_bench.checkpoint import load_params, save_params
from bdl_bench.data import build_dataset
from bdl_bench.orchestration.reproduce import main
from bdl_bench.report.def_hessian import zero_information, zero_table
from bdl_bench.report.frobenius import run_block


def test_zero_information_counts_zero_diagonal_entries_relative_to_the_largest() -> None:
    basis = torch.randn(6, 4, dtype=torch.float64)
    basis[[1, 4]] = 0.0  # two parameters without information: zero rows and columns of B B^T
    block = 1e6 * basis @ basis.mT
    block[1, 1] = 1e-8  # rounding noise far below 1e-10 of the largest entry still counts as zero
    assert zero_information(block) == 2
    assert zero_information(torch.eye(3)) == 0


def test_zero_table_summarises_each_training_size_over_its_seeds() -> None:
    dead = torch.diag(torch.tensor([1.0, 0.0, 0.0, 2.0]))
    alive = torch.eye(4)
    table = zero_table([(20, 0, dead), (20, 1, alive), (100, 0, alive), (100, 1, alive)])
    assert list(table["n_train"]) == [20, 100]
    assert list(table["zero_diag"]) == [1.0, 0.0]
    assert table["zero_diag_se"].iloc[0] == pytest.approx(1.0)  # counts 2 and 0
    assert list(table["per_seed"]) == ["2 0", "0 0"]


@pytest.mark.slow
def test_quick_def_hessian_draws_fig9_and_counts_a_dead_units_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quick reproduction runs both sizes and writes the figure and its table; then one run's first unit is
    switched off (a bias far below its weight times any standardised input), and the block of that run has
    exactly that unit's weight and bias without information, as the forward pass says it must."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    main(["def_hessian", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"])
    folder = tmp_path / "def_hessian_quick"
    assert (folder / "def_hessian.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["n_train"]) == [20, 100] and list(table["n_runs"]) == [5, 5]
    assert (table["n_params"] == 14).all()  # the 1 -> 7 layer with its biases

    run_dir = sorted(p.parent for p in folder.rglob("params.pt"))[0]
    params = load_params(run_dir / "params.pt")
    theta = params["theta"].clone()
    hidden = 7
    theta[0], theta[hidden] = 0.01, -100.0  # unit 0: weight 0.01, bias -100 -> inactive on every input
    save_params(run_dir / "params.pt", theta, method=params["method"], config_hash=params["config_hash"])
    block, config = run_block(run_dir)
    x = build_dataset(config["data"]).x_train.double()  # (N, 1), standardised as the run saw it
    active = x @ theta[:hidden].double()[None, :] + theta[hidden : 2 * hidden].double() > 0  # (N, 7) ReLU gates
    dead = (~active).all(dim=0)
    assert dead[0] and int(dead.sum()) >= 1
    # augmented row-major order: unit u's weight is parameter 2u, its bias 2u + 1
    expected = torch.stack([dead, dead], dim=1).reshape(-1)
    diagonal = block.diagonal()
    assert torch.equal(diagonal <= 1e-10 * diagonal.max(), expected)
    assert zero_information(block) == 2 * int(dead.sum())

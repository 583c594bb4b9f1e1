"""DEF Table 1's CIFAR-10 half and Table 2's CIFAR-10 rows (`bdl-bench reproduce def_table1_cifar10`), whose data
cannot be downloaded here: all seven columns end to end on small generated archives in the real formats (CIFAR-10's
binary tarball, SVHN's .mat test file), --quick, a tiny CNN."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from _archives import register_archive, write_cifar_archive, write_svhn_mat

from bdl_bench.data.cifar import CIFAR10
from bdl_bench.orchestration.reproduce import main


@pytest.mark.slow
def test_def_table1_cifar10_runs_every_column_against_svhn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BDL_BENCH_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    register_archive(monkeypatch, CIFAR10.key, write_cifar_archive(mirror / "cifar-10-binary.tar.gz", CIFAR10, 4))
    write_svhn_mat(mirror / "test_32x32.mat", 6, seed=0)
    register_archive(monkeypatch, "svhn/test_32x32.mat", mirror / "test_32x32.mat")
    args = ["def_table1_cifar10", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"]
    args += [f"data.mirror={mirror}", f"data.root={tmp_path / 'cache'}", "data.n_val=8"]
    args += ["model.channels=2", "model.hidden=[4,3]", "trainer.n_test_mc_samples=2"]
    args += ["laplace_search.dataset_scale=[12]", "laplace_search.prior_precision.logspace=[2,4,2]"]
    args += ["laplace_search.n_samples=2"]
    main(args)
    folder = tmp_path / "def_table1_cifar10_quick"
    report = (folder / "reproduce.md").read_text()
    assert "finished: `7 of 7 runs`" in report
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    columns = ["def", "diag", "efb", "ensemble15", "kfac", "mc_dropout", "nn"]
    rows = table[table["dataset"] == "cifar10"].set_index("method")
    assert sorted(rows.index) == columns  # beside the paper's CIFAR column, which has no MC-dropout value
    assert rows["paper_accuracy"].drop("mc_dropout").tolist() == [0.8646, 0.8659, 0.8638, 0.8651, 0.8572, 0.8606]
    assert "Protocol: App. E.3's CIFAR-10 CNN" in report
    assert (folder / "fig6_ood_entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "table2_def_ranks (the figure's numbers)" in report and "| FC-1 |" in report
    configs = [yaml.safe_load(p.read_text()) for p in folder.rglob("config.yaml") if p.parent.name != ".hydra"]
    dropout = [c for c in configs if c["method"]["name"] == "dropout"][0]
    assert dropout["model"]["name"] == "cnn_def" and dropout["model"]["dropout"] == 0.6
    assert {c["data"]["ood"] for c in configs} == {"svhn"} and {c["prior_precision"] for c in configs} == {160}

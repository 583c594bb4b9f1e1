"""The k-tied artefacts whose data cannot be downloaded here (CIFAR-10/100, IMDB): each `bdl-bench reproduce` runs end
to end on a small generated archive in the real format (--quick, tiny networks) and writes its files — the command
the status page gives for where the data is reachable."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from _archives import register_archive, write_cifar_archive, write_imdb_archive

from bdl_bench.data.cifar import CIFAR10, CIFAR100
from bdl_bench.orchestration.reproduce import main

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["trainer.n_test_mc_samples=4", "trainer.n_elbo_mc_samples=2", "trainer.n_eval_mc_samples=2"]


@pytest.fixture()
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline folder for the archives; the Hydra sweep runs in this process."""
    monkeypatch.setenv("BDL_BENCH_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    folder = tmp_path / "mirror"
    folder.mkdir()
    return folder


def _reproduce(experiment: str, tmp_path: Path, mirror: Path, *overrides: str) -> tuple[Path, str, pd.DataFrame]:
    data = [f"data.mirror={mirror}", f"data.root={tmp_path / 'cache'}"]
    main([experiment, "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}", *data, *overrides])
    folder = tmp_path / f"{experiment}_quick"
    return folder, (folder / "reproduce.md").read_text(), pd.read_csv(folder / "reproduce.csv", comment="#")


def _rank_rows(table: pd.DataFrame, figure: str) -> pd.DataFrame:
    rows = table[table["figure"] == figure].set_index("method")
    assert list(rows.index) == ["mean_field", *(f"mean_field, rank-{k} std" for k in (1, 2, 3))]
    return rows


@pytest.mark.slow
def test_ktied_table2_cifar100_draws_fig3_fig4_and_the_cnn_rows(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_archive(monkeypatch, CIFAR100.key, write_cifar_archive(mirror / "cifar-100-binary.tar.gz", CIFAR100, 24))
    tiny = ["model.channels=[2,3]", "model.hidden=6", "data.n_val=4", *SMALL]
    folder, report, table = _reproduce("ktied_table2_cifar100", tmp_path, mirror, *tiny)
    assert (folder / "fig3_spectra.png").read_bytes()[:8] == PNG and (folder / "fig4_heatmaps.png").read_bytes()[
        :8
    ] == PNG
    # only the dense layers are studied: FC 6 x 192 (3 channels x 8 x 8 after two pools of a 32 x 32 image), 100 x 6
    assert "| dense 1 | 6 x 192 | stds |" in report and "| dense 2 | 100 x 6 | stds |" in report
    assert "| conv" not in report
    assert "| rank-2 approximation |" in report
    rows = _rank_rows(table, "table2_low_rank")
    assert rows["paper_neg_elbo"].tolist() == [3.83, 4.33, 3.88, 3.86] and "Table 2 (CIFAR-100 CNN)" in report
    heat = table[table["figure"] == "fig4_heatmaps"].set_index("rank")["relative_error"]
    assert list(heat.index) == [0, 1, 2] and heat[0] == 0 and heat[1] >= heat[2] - 1e-6 >= -1e-6
    config = yaml.safe_load(next(folder.rglob("config.yaml")).read_text())
    assert config["model"]["name"] == "cnn_ktied" and config["method"]["kl_annealing_steps"] == 0


@pytest.mark.slow
def test_ktied_table2_imdb_studies_the_lstm_kernels(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_archive(monkeypatch, "imdb/aclImdb_v1.tar.gz", write_imdb_archive(mirror / "aclImdb_v1.tar.gz"), md5=True)
    tiny = ["data.vocab_size=6", "data.max_len=4", "data.n_val=2", "model.embedding_dim=3", "model.hidden_size=2"]
    folder, report, table = _reproduce("ktied_table2_imdb", tmp_path, mirror, *tiny, *SMALL)
    assert (folder / "fig3_spectra.png").read_bytes()[:8] == PNG
    assert "| lstm weight_ih_l0 | 8 x 3 | stds |" in report and "| lstm weight_hh_l0 | 8 x 2 | stds |" in report
    rows = _rank_rows(table, "table2_low_rank")
    assert rows["paper_accuracy"].tolist() == [80.1, 80.0, 80.1, 80.1] and "Table 2 (IMDB LSTM)" in report


@pytest.mark.slow
def test_ktied_fig5_studies_resnet18s_convolutions_and_prints_table3(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_archive(monkeypatch, CIFAR10.key, write_cifar_archive(mirror / "cifar-10-binary.tar.gz", CIFAR10, 4))
    folder, report, table = _reproduce("ktied_fig5", tmp_path, mirror, "model.base_width=2", *SMALL)
    assert (folder / "fig5_top_spectra.png").read_bytes()[:8] == PNG
    assert "| conv 1 | 2 x 27 | stds |" in report and "| dense 1 | 10 x 16 | stds |" in report
    rows = _rank_rows(table, "fig5_bottom_table3")
    assert rows["paper_brier_tfp"].tolist() == [-0.761, -0.695, -0.758, -0.758]
    assert rows["paper_ece"].tolist() == [0.0477, 0.1642, 0.0540, 0.0541]
    assert (rows["brier_tfp"] >= -1).all() and (rows["brier_tfp"] <= 1).all()  # the usual Brier lies in [0, 2]
    assert "Fig. 5 bottom and Table 3 (CIFAR-10 ResNet-18)" in report and "Brier (TFP) (ours)" in report
    # rank k keeps k(m + n) numbers per studied matrix; the convolutions are among them
    counts = rows["n_variational_params"].tolist()
    assert counts[1] < counts[2] < counts[3] < counts[0]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["cifar100", "imdb"])
def test_ktied_fig6_on_the_cnn_and_the_lstm_draws_fig6_left_and_fig7(
    dataset: str, tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The four columns train, ktied ties the CNN's dense layers (its convolutions stay mean-field) and the LSTM's
    kernels: the parameter counts are the k-tied method's; Fig. 7's records come at the (here shortened) steps."""
    if dataset == "cifar100":
        archive = write_cifar_archive(mirror / "cifar-100-binary.tar.gz", CIFAR100, 24)
        register_archive(monkeypatch, CIFAR100.key, archive)
        tiny = ["model.channels=[2,3]", "model.hidden=6", "data.n_val=4", "trainer.batch_size=5"]
        paper_counts = [4405, 2262, 2268, 2273]
    else:
        register_archive(
            monkeypatch, "imdb/aclImdb_v1.tar.gz", write_imdb_archive(mirror / "aclImdb_v1.tar.gz"), md5=True
        )
        tiny = ["data.vocab_size=6", "data.max_len=4", "data.n_val=2", "model.embedding_dim=3", "model.hidden_size=2"]
        tiny += ["trainer.batch_size=1"]
        paper_counts = [2823, 2693, 2694, 2695]
    steps = ["method.record_every=4", "figures.1.steps=[4,8]"]
    folder, report, table = _reproduce(f"ktied_fig6_{dataset}", tmp_path, mirror, *tiny, *SMALL, *steps)
    assert (folder / "fig7.png").read_bytes()[:8] == PNG
    left = table[table["figure"] == "fig6_left"].set_index("method")
    assert sorted(left.index) == ["1_tied", "2_tied", "3_tied", "mean_field"]
    assert [left.loc[c, "paper_n_variational_params_k"] for c in ("mean_field", "1_tied", "2_tied", "3_tied")] == (
        paper_counts
    )
    counts = [left.loc[c, "n_variational_params"] for c in ("mean_field", "1_tied", "2_tied", "3_tied")]
    assert counts[1] < counts[2] < counts[3] and counts[1] < counts[0]
    if dataset == "imdb":  # D = 77 (embedding 18, LSTM 4·2·(3 + 2) + 2·8, dense 3); tied: 8 x 3, 8 x 2, 1 x 2
        assert counts == [2 * 77, 2 * 77 - 42 + 24, 2 * 77 - 42 + 22 + 20 + 3, 2 * 77 - 42 + 33 + 20 + 3]
    fig7 = table[table["figure"] == "fig7"]
    assert sorted(set(fig7["step"])) == [4, 8] and fig7["paper_val_neg_elbo"].isna().all()  # MNIST's only
    # KL annealed over the run's epochs of the paper's training set (40,000 images; 20,000 reviews), not MNIST's
    configs = [yaml.safe_load(p.read_text()) for p in folder.rglob("config.yaml") if p.parent.name != ".hydra"]
    n_train, batch = (40000, 5) if dataset == "cifar100" else (20000, 1)
    assert len(configs) == 4 and {c["method"]["kl_annealing_steps"] for c in configs} == {3 * n_train // batch}

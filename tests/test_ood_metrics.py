"""Calibration and OOD metrics on hand-made cases, and the figures drawn from them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bdl_bench.metrics import (
    expected_calibration_error,
    ood_auroc,
    ood_metrics,
    predictive_entropy,
    reliability_from_confidence,
    uncertainty_arrays,
)


def reliability_diagram(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15):
    confidence, predicted = probs.max(dim=-1)
    return reliability_from_confidence(confidence, predicted == labels, n_bins)


def test_ece_hand_computed() -> None:
    # Confidences 0.9 (correct), 0.9 (wrong), 0.6 (correct), 0.55 (correct); 15 bins of width 1/15.
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.4, 0.6], [0.55, 0.45]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0])
    # bin of 0.9: accuracy 1/2, confidence 0.9; bin of 0.6 (0.6 -> ceil(9) - 1 = 8): acc 1, conf 0.6;
    # bin of 0.55 (ceil(8.25) - 1 = 8): the same bin -> acc 1, conf 0.575 over 2 examples.
    expected = 0.5 * abs(0.5 - 0.9) + 0.5 * abs(1.0 - 0.575)
    assert expected_calibration_error(probs, labels) == pytest.approx(expected)
    assert reliability_diagram(probs, labels).ece == pytest.approx(expected)


def test_ece_is_zero_when_perfectly_calibrated_and_maximal_when_confidently_wrong() -> None:
    probs = torch.tensor([[0.75, 0.25]] * 4, dtype=torch.float64)
    assert expected_calibration_error(probs, torch.tensor([0, 0, 0, 1])) == pytest.approx(0.0)
    wrong = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert expected_calibration_error(wrong, torch.tensor([1, 0])) == pytest.approx(1.0)


def test_reliability_diagram_bins() -> None:
    probs = torch.tensor([[0.95, 0.05], [0.05, 0.95], [0.5, 0.5]], dtype=torch.float64)
    diagram = reliability_diagram(probs, torch.tensor([0, 0, 1]), n_bins=10)
    assert diagram.bin_edges.shape == (11,) and int(diagram.counts.sum()) == 3
    assert diagram.counts[9] == 2 and diagram.counts[4] == 1  # 0.95, 0.95 -> last bin; 0.5 -> bin (0.4, 0.5]
    assert diagram.accuracy[9] == pytest.approx(0.5) and diagram.confidence[9] == pytest.approx(0.95)
    assert diagram.accuracy[4] == pytest.approx(0.0)  # argmax of a tie is class 0, the label is 1
    assert math.isnan(float(diagram.accuracy[0]))  # empty bins are NaN


def test_predictive_entropy_normalised_by_log_classes() -> None:
    probs = torch.tensor([[0.25] * 4, [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(predictive_entropy(probs), torch.tensor([1.0, 0.0, 0.5]))
    torch.testing.assert_close(predictive_entropy(probs, normalise=False)[2], torch.tensor(math.log(2)))
    with pytest.raises(ValueError, match="C >= 2"):
        predictive_entropy(torch.ones(3, 1))


def test_auroc_hand_cases() -> None:
    certain = torch.tensor([[0.99, 0.01], [0.98, 0.02]])
    unsure = torch.tensor([[0.5, 0.5], [0.6, 0.4]])
    assert ood_auroc(certain, unsure) == pytest.approx(1.0)  # OOD always more uncertain
    assert ood_auroc(unsure, certain) == pytest.approx(0.0)
    assert ood_auroc(certain, certain) == pytest.approx(0.5)  # indistinguishable
    # One of 2 x 2 pairs ordered wrongly: in-entropies {H(.99), H(.6)}, OOD {H(.5), H(.98)}.
    mixed_in = torch.tensor([[0.99, 0.01], [0.6, 0.4]])
    mixed_ood = torch.tensor([[0.5, 0.5], [0.98, 0.02]])
    assert ood_auroc(mixed_in, mixed_ood) == pytest.approx(0.75)  # pairs won: (.5>.99), (.5>.6), (.98>.99)


def test_ood_metrics_keys_and_values() -> None:
    metrics = ood_metrics(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    assert metrics["ood_entropy_mean"] == pytest.approx(0.5)
    assert metrics["ood_entropy_std"] == pytest.approx(math.sqrt(0.5))  # sample std of {1, 0}
    assert metrics["in_entropy_mean"] == pytest.approx(0.0) and metrics["ood_auroc"] == pytest.approx(0.75)


def test_uncertainty_figure_from_a_run_folder(tmp_path: Path, generator: torch.Generator) -> None:
    from bdl_bench.report.ood_plots import entropy_groups, plot_uncertainty

    probs = torch.softmax(3 * torch.randn(200, 10, generator=generator), -1)
    labels = torch.randint(0, 10, (200,), generator=generator)
    ood = torch.softmax(torch.randn(100, 10, generator=generator), -1)
    arrays = uncertainty_arrays(probs, labels, ood)
    assert set(arrays) == {"test_confidence", "test_correct", "test_entropy", "ood_entropy"}
    run = tmp_path / "run"
    run.mkdir()
    np.savez(run / "uncertainty.npz", **arrays)
    out = plot_uncertainty([run], tmp_path / "ood.png")
    assert out.stat().st_size > 1000
    # DEF Fig. 6's groups: correctly classified test images against notMNIST and the misclassified ones
    groups = entropy_groups(arrays, "paper")
    correct = arrays["test_correct"].astype(bool)
    assert len(groups["in-dist (correct test)"]) == correct.sum()
    assert len(groups["out-dist (OOD and misclassified)"]) == 100 + (~correct).sum()
    assert plot_uncertainty([run], tmp_path / "paper.png", grouping="paper").stat().st_size > 1000
    with pytest.raises(ValueError, match="grouping"):
        entropy_groups(arrays, "ours")
    with pytest.raises(FileNotFoundError, match="uncertainty.npz is missing"):
        plot_uncertainty([tmp_path], tmp_path / "x.png")

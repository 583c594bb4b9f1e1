"""Gradient SNR (Swiatkowski et al. 2020, footnote 3) on constructed gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from bdl_bench.methods._grad_snr import GradientSNR, gradient_snr, mean_snr, median_snr


def test_snr_of_constructed_gradients() -> None:
    grads = torch.tensor(
        [
            [1.0, 2.0, 0.0, -1.0],
            [3.0, 2.0, 0.0, 1.0],
            [1.0, 2.0, 0.0, -1.0],
            [3.0, 2.0, 0.0, 1.0],
        ]
    )
    snr = gradient_snr(grads)
    # column 0: E[g^2] = 5, Var = 1; column 1: no noise; column 2: no signal; column 3: zero mean, E[g^2] = Var
    assert snr[0] == pytest.approx(5.0)
    assert math.isinf(snr[1])
    assert math.isnan(snr[2])
    assert snr[3] == pytest.approx(1.0)
    assert mean_snr(torch.tensor([5.0, float("nan"), 1.0])) == pytest.approx(3.0)
    assert math.isnan(mean_snr(torch.tensor([float("nan")])))
    with pytest.raises(ValueError, match="at least 2"):
        gradient_snr(grads[:1])


def test_windows_record_the_snr_of_their_steps() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [
        {
            "a": [torch.randn(3, 2, generator=g) + 2.0],
            "b": [torch.randn(4, generator=g), torch.randn(2, generator=g) + 1],
        }
        for _ in range(9)
    ]
    tracker = GradientSNR(window=4)
    for t, grads in enumerate(steps, start=1):
        tracker.update(t, grads)
    assert [step for step, _ in tracker.records] == [4, 8]  # step 9 starts a third window
    for (_, values), first in zip(tracker.records, (0, 4)):
        window = steps[first : first + 4]
        snr_a = gradient_snr(torch.stack([s["a"][0] for s in window]))
        snr_b = torch.cat([gradient_snr(torch.stack([s["b"][i] for s in window])) for i in range(2)])
        assert values["a"] == pytest.approx(float(snr_a.mean()), rel=1e-5)
        assert values["b"] == pytest.approx(float(snr_b.mean()), rel=1e-5)
        assert values["all"] == pytest.approx(float(torch.cat([snr_a.flatten(), snr_b]).mean()), rel=1e-5)
        assert values["median_a"] == pytest.approx(float(snr_a.flatten().median()), rel=1e-5)
        assert values["median"] == pytest.approx(float(torch.cat([snr_a.flatten(), snr_b]).median()), rel=1e-5)
    means = tracker.pop_means()
    assert means["a"] == pytest.approx((tracker.records[0][1]["a"] + tracker.records[1][1]["a"]) / 2)
    assert tracker.pop_means() == {}  # nothing new since


def test_large_snr_survives_float32_gradients() -> None:
    """E[g^2] - E[g]^2 is accumulated in float64: an SNR of ~1e8 is not lost to cancellation."""
    base = torch.full((5,), 3.0)
    grads = [base + 3e-4 * (-1) ** t for t in range(10)]
    tracker = GradientSNR(window=10)
    for t, grad in enumerate(grads, start=1):
        tracker.update(t, {"w": [grad.float()]})
    expected = gradient_snr(torch.stack(grads).double()).mean()
    assert_close(torch.tensor(tracker.records[0][1]["w"]), expected.float(), rtol=1e-3, atol=0)


def test_median_is_finite_while_fewer_than_half_do_not_vary() -> None:
    """A parameter whose gradient is constant over the window (only the KL moves it) has an infinite SNR and
    makes the paper's mean infinite; the median stays that of the noisy parameters."""
    g = torch.Generator().manual_seed(0)
    noisy = [torch.randn(7, generator=g) + 1.0 for _ in range(10)]
    tracker = GradientSNR(window=10)
    for t, grad in enumerate(noisy, start=1):
        tracker.update(t, {"w": [torch.cat([grad, torch.tensor([0.5, 0.5, 0.0])])]})  # constant, constant, zero
    values = tracker.records[0][1]
    assert math.isinf(values["w"])
    snr_noisy = gradient_snr(torch.stack(noisy).double())
    # 9 kept values (the all-zero one is no signal): 7 noisy and two infinite; the median is the 5th smallest
    assert values["median_w"] == pytest.approx(float(snr_noisy.sort().values[4]), rel=1e-5)
    assert math.isfinite(values["median"])
    assert median_snr(torch.tensor([1.0, float("inf"), float("nan"), 3.0, 2.0])) == pytest.approx(2.0)
    assert math.isnan(median_snr(torch.tensor([float("nan")])))


@pytest.mark.parametrize("window", [0, 1, 2.5])
def test_bad_window_raises(window: float) -> None:
    with pytest.raises(ValueError, match="window"):
        GradientSNR(window=window)

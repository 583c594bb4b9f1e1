"""DEF Figs. 7 and 8 (reproduce def_toy20): the first layer's posterior covariance of KFAC with eq. 3's damping
and of the undamped Kronecker form (OKF), end to end on a tiny budget."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bdl_bench.orchestration.reproduce import main
from bdl_bench.report.layer_covariance import layer_covariances


@pytest.mark.slow
def test_quick_def_toy20_draws_figs_7_and_8_and_eq3_damps_the_covariance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eq. 3 adds the PSD cross terms sqrt(N tau) (G (x) I + I (x) A) to OKF's precision N G (x) A + tau I, so at
    the same N and tau KFAC's covariance is below OKF's in the Loewner order: OKF minus KFAC is PSD."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the Hydra sweep runs in this process
    main(["def_toy20", "--quick", "--jobs", "1", "hydra/launcher=basic", f"results_root={tmp_path}"])
    folder = tmp_path / "def_toy20_quick"
    for name in ("fig7_toy20", "fig8_okf", "fig8_covariance"):
        assert (folder / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = pd.read_csv(folder / "reproduce.csv", comment="#")
    assert list(table["variant"]) == ["kfac", "kfac_okf"]
    covariances = layer_covariances(folder, ["kfac", "kfac_okf"])
    kfac, okf = covariances["kfac"], covariances["kfac_okf"]
    assert kfac.shape == okf.shape == (14, 14)  # the 1 -> 7 layer: 7 weights, 7 biases
    assert np.linalg.eigvalsh(okf - kfac).min() > -1e-9 * np.abs(okf).max()
    assert table["trace"].iloc[1] > table["trace"].iloc[0]
    assert table["trace"].iloc[0] == pytest.approx(np.trace(kfac))

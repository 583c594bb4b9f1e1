r"""Validation negative ELBO and gradient SNR at given training steps (Swiatkowski et al. 2020, Fig. 6 right and
Fig. 7 read them at steps 1000, 5000 and 9000, inside epochs): with ``record_every`` R > 0 a layer-wise VI method
writes a row of ``steps.csv`` after every R-th step t (its columns: docs/running.md). ``val_nll`` is
:math:`\frac1S \sum_s \frac1{N_{val}} \sum_{i \in val} -\log p(y_i \mid x_i, \theta_s)` over S networks drawn
from q, ``val_neg_elbo`` that plus :math:`\mathrm{KL}(q_t \,\|\, p) / N` (the full KL, not the annealed
:math:`\beta_t`, so at initialisation the KL dominates it).

The networks are drawn with a generator seeded from the method's seed and t, so recording never moves the
training stream. The rows are part of the checkpoint and the file is rewritten whole after each record, so a
resumed run drops the rows it recomputes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from bdl_bench.errors import ConfigError
from bdl_bench.results import atomic_write_text

STEPS_FILE = "steps.csv"


@dataclass
class StepRecorder:
    """The ``steps.csv`` rows of one run (see the module docstring)."""

    every: int
    n_samples: int = 10
    rows: list[dict[str, float]] = field(default_factory=list)
    x_val: Tensor | None = None
    y_val: Tensor | None = None
    path: Path | None = None

    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None) -> None:
        self.x_val, self.y_val = x_val, y_val
        self.path = None if run_dir is None else Path(run_dir) / STEPS_FILE

    def check(self, name: str) -> None:
        """Refuse to record without a validation set."""
        if self.x_val is None or self.x_val.shape[0] == 0:
            raise ConfigError(f"{name}: method.record_every needs a validation set (data.n_val > 0)")

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def record(self, method: Any, step: int, kl_weight: float, snr: tuple[int, dict[str, float]] | None) -> None:
        """Append step ``step``'s row (``method``: a fitted layer-wise VI method) and rewrite the file."""
        self.check(method.name)
        problem = method.problem
        generator = torch.Generator(device=self.x_val.device).manual_seed(problem.generator.initial_seed() + step)
        method.problem = dataclasses.replace(problem, generator=generator)
        try:
            f = method.predict(self.x_val, self.n_samples)  # (S, N_val, out)
        finally:
            method.problem = problem
        nll = float(torch.stack([problem.likelihood.nll(f_s, self.y_val).mean() for f_s in f]).mean())
        kl = float(method.kl_to_prior()) / problem.n_data
        row = {"step": step, "val_nll": nll, "kl": kl, "val_neg_elbo": nll + kl, "kl_weight": kl_weight}
        if snr is not None:
            row["snr_step"] = snr[0]
            row.update({("grad_snr" if k == "all" else f"grad_snr_{k}"): v for k, v in snr[1].items()})
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        if self.path is not None and self.rows:
            atomic_write_text(self.path, pd.DataFrame(self.rows).to_csv(index=False))

    def state_dict(self) -> list[dict[str, float]]:
        return [dict(r) for r in self.rows]

    def load_state_dict(self, rows: list[dict[str, float]]) -> None:
        self.rows = [dict(r) for r in rows]

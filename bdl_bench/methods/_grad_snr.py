r"""Signal-to-noise ratio of stochastic gradients over windows of consecutive steps.

Swiatkowski et al. (2020), Sec. 3.2 and footnote 3: for one parameter with gradients
:math:`g_1, \dots, g_W` over a window of the last :math:`W` batches (the paper uses W = 10),

.. math::

    \mathrm{SNR} = \frac{\mathbb E[g^2]}{\operatorname{Var}[g]}
        = \frac{\frac1W \sum_t g_t^2}{\frac1W \sum_t g_t^2 - \bigl(\frac1W \sum_t g_t\bigr)^2},

with the window's (population) mean and variance, and a layer's SNR is the mean over its parameters.
This is the paper's formula as written; it equals :math:`1 + \bar g^2 / \operatorname{Var}[g]`, one
plus the more common squared-mean-over-variance ratio. Parameters whose gradient is exactly zero over
the whole window (no signal, e.g. dead ReLU units) are left out of the mean.

The mean of ratios is at the mercy of its largest terms: a parameter whose gradient barely varies over
the window has an SNR of :math:`10^6` or more, and one whose gradient does not vary at all (in float32:
a weight that only the deterministic KL term moves, e.g. one fed by MNIST's always-zero border pixels or
by a dead ReLU unit, once its update no longer changes its gradient's float32 value) has an infinite
SNR, which makes the layer's mean infinite. Each record therefore also holds the median over the
parameters (``median`` for all layers, ``median_<group>`` per group), which such parameters cannot move
while they are fewer than half.

:class:`GradientSNR` accumulates running sums (float64) over non-overlapping windows of ``window`` steps
(two passes over the tracked gradients per step, no stored history) and records one value per group at
the end of each window, i.e. the SNR "over the last W batches" at steps W, 2W, 3W, ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def gradient_snr(grads: Tensor) -> Tensor:
    r"""Per-parameter :math:`\mathbb E[g^2] / \operatorname{Var}[g]` over the first dimension.

    Args:
        grads: gradients of W steps, ``(W, ...)``, W >= 2.

    Returns:
        ``grads.shape[1:]``; ``nan`` where every gradient is zero, ``inf`` where a nonzero gradient
        does not vary.

    Raises:
        ValueError: with fewer than two steps.
    """
    if grads.shape[0] < 2:
        raise ValueError(f"gradient SNR needs at least 2 steps, got {grads.shape[0]}")
    return _snr_from_sums(grads.sum(0), grads.square().sum(0), grads.shape[0])


def _snr_from_sums(total: Tensor, total_sq: Tensor, count: int) -> Tensor:
    second_moment = total_sq / count
    variance = (second_moment - (total / count) ** 2).clamp_min(0.0)
    return second_moment / variance  # 0/0 = nan (no signal), x/0 = inf (no noise)


def mean_snr(snr: Tensor) -> float:
    """Mean of per-parameter SNRs, leaving out ``nan`` (all-zero gradients); ``nan`` if none is left."""
    kept = snr[~torch.isnan(snr)]
    return float(kept.mean()) if kept.numel() else float("nan")


def median_snr(snr: Tensor) -> float:
    """Median (the lower of the two middle values) of per-parameter SNRs, leaving out ``nan``; ``nan`` if
    none is left. Infinite SNRs count as large values, so it is finite while fewer than half are."""
    kept = snr[~torch.isnan(snr)]
    return float(kept.median()) if kept.numel() else float("nan")


@dataclass
class _Window:
    total: list[Tensor]
    total_sq: list[Tensor]


@dataclass
class GradientSNR:
    """Running gradient sums per named group of tensors, one SNR value per group and window.

    Args:
        window: steps per window W (>= 2).

    Attributes:
        records: ``(step, {key: snr})`` for every completed window, in order; the keys are each group's
            name (its mean SNR), ``all`` (the mean over all groups' parameters), ``median_<group>`` and
            ``median`` (the medians of the same sets).
    """

    window: int
    records: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _sums: dict[str, _Window] = field(default_factory=dict)
    _count: int = 0
    _unread: int = 0  # records not yet returned by ``pop_means``

    def __post_init__(self) -> None:
        if int(self.window) != self.window or self.window < 2:
            raise ValueError(f"snr window must be an integer >= 2, got {self.window}")

    def update(self, step: int, grads: Mapping[str, Sequence[Tensor]]) -> None:
        """Add one step's gradients (``{group: [tensors]}``, the same groups and shapes every step)."""
        for name, tensors in grads.items():
            sums = self._sums.get(name)
            if sums is None:
                # float64 sums: E[g^2] - E[g]^2 cancels badly in float32 when the SNR is large
                sums = self._sums[name] = _Window(
                    [torch.zeros_like(t, dtype=torch.float64) for t in tensors],
                    [torch.zeros_like(t, dtype=torch.float64) for t in tensors],
                )
            torch._foreach_add_(sums.total, list(tensors))
            torch._foreach_addcmul_(sums.total_sq, list(tensors), list(tensors))
        self._count += 1
        if self._count == self.window:
            values, every = {}, []
            for name, sums in self._sums.items():
                snr = torch.cat(
                    [_snr_from_sums(t, s, self._count).flatten() for t, s in zip(sums.total, sums.total_sq)]
                )
                values[name] = mean_snr(snr)
                values[f"median_{name}"] = median_snr(snr)
                every.append(snr)
                torch._foreach_zero_(sums.total)
                torch._foreach_zero_(sums.total_sq)
            every = torch.cat(every)
            values["all"], values["median"] = mean_snr(every), median_snr(every)
            self.records.append((step, values))
            self._unread += 1
            self._count = 0

    def pop_means(self) -> dict[str, float]:
        """Mean per group over the windows completed since the last call (empty if none)."""
        fresh = self.records[len(self.records) - self._unread :] if self._unread else []
        self._unread = 0
        if not fresh:
            return {}
        names = fresh[0][1].keys()
        return {name: sum(values[name] for _, values in fresh) / len(fresh) for name in names}

    def reset(self) -> None:
        """Drop the partial window (e.g. after restoring a checkpoint)."""
        for sums in self._sums.values():
            torch._foreach_zero_(sums.total)
            torch._foreach_zero_(sums.total_sq)
        self._count = 0

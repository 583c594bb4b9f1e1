r"""Signal-to-noise ratio of stochastic gradients over windows of consecutive steps.

Swiatkowski et al. (2020), Sec. 3.2 and footnote 3: for one parameter with gradients
:math:`g_1, \dots, g_W` over a window of the last :math:`W` batches (the paper uses W = 10),

.. math::

    \mathrm{SNR} = \frac{\mathbb E[g^2]}{\operatorname{Var}[g]}
        = \frac{\frac1W \sum_t g_t^2}{\frac1W \sum_t g_t^2 - \bigl(\frac1W \sum_t g_t\bigr)^2}

(the paper's formula as written: :math:`1 + \bar g^2 / \operatorname{Var}[g]`), and a layer's SNR is the mean
over its parameters, leaving out those whose gradient is zero over the whole window. A gradient that does not
vary at all (in float32, e.g. a weight only the KL term moves) has an infinite SNR, which makes the mean
infinite; each record therefore also holds the median over the parameters, which such parameters cannot move
while they are fewer than half.

:class:`GradientSNR` accumulates running sums (float64) over non-overlapping windows and records one value
per group at steps W, 2W, 3W, ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def gradient_snr(grads: Tensor) -> Tensor:
    r"""Per-parameter :math:`\mathbb E[g^2] / \operatorname{Var}[g]` of the gradients of W >= 2 steps ``(W, ...)``:
    ``nan`` where every gradient is zero, ``inf`` where a nonzero gradient does not vary."""
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
    """Median (the lower middle value) of per-parameter SNRs, leaving out ``nan``; ``nan`` if none is left."""
    kept = snr[~torch.isnan(snr)]
    return float(kept.median()) if kept.numel() else float("nan")


@dataclass
class GradientSNR:
    """Running gradient sums per named group of tensors over windows of ``window`` steps. ``records`` holds
    ``(step, {key: snr})`` per completed window, the keys each group's name (its mean SNR), ``all`` (the mean
    over all groups' parameters), ``median_<group>`` and ``median``."""

    window: int
    records: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _sums: dict[str, tuple[list[Tensor], list[Tensor]]] = field(default_factory=dict)  # group: sums of g, g^2
    _count: int = 0
    _unread: int = 0  # records not yet returned by ``pop_means``

    def __post_init__(self) -> None:
        if int(self.window) != self.window or self.window < 2:
            raise ValueError(f"snr window must be an integer >= 2, got {self.window}")

    def update(self, step: int, grads: Mapping[str, Sequence[Tensor]]) -> None:
        """Add one step's gradients (``{group: [tensors]}``, the same groups and shapes every step)."""
        for name, tensors in grads.items():
            if name not in self._sums:
                # float64 sums: E[g^2] - E[g]^2 cancels badly in float32 when the SNR is large
                zeros = [torch.zeros_like(t, dtype=torch.float64) for t in tensors]
                self._sums[name] = (zeros, [z.clone() for z in zeros])
            total, total_sq = self._sums[name]
            torch._foreach_add_(total, list(tensors))
            torch._foreach_addcmul_(total_sq, list(tensors), list(tensors))
        self._count += 1
        if self._count == self.window:
            values, every = {}, []
            for name, (total, total_sq) in self._sums.items():
                snr = torch.cat([_snr_from_sums(t, s, self._count).flatten() for t, s in zip(total, total_sq)])
                values[name] = mean_snr(snr)
                values[f"median_{name}"] = median_snr(snr)
                every.append(snr)
            every = torch.cat(every)
            values["all"], values["median"] = mean_snr(every), median_snr(every)
            self.records.append((step, values))
            self._unread += 1
            self.reset()

    def pop_means(self) -> dict[str, float]:
        """Mean per group over the windows completed since the last call (empty if none)."""
        fresh = self.records[len(self.records) - self._unread :] if self._unread else []
        self._unread = 0
        if not fresh:
            return {}
        names = fresh[0][1].keys()
        return {name: sum(values[name] for _, values in fresh) / len(fresh) for name in names}

    def reset(self) -> None:
        """Start a new window (dropping a partial one, e.g. after restoring a checkpoint)."""
        for total, total_sq in self._sums.values():
            torch._foreach_zero_(total)
            torch._foreach_zero_(total_sq)
        self._count = 0

"""Progress bars for long loops inside a run (the run's own bar counts epochs): shown only when the run
shows progress (``trainer.progress``) and only once the loop has run :data:`BAR_DELAY_S` seconds, so the
many short loops stay silent and the long ones (an hour-long ensemble epoch, a Laplace curvature pass over
50,000 images) show where they are."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

BAR_DELAY_S = 10.0
"""A bar appears once its loop has run this long (tqdm's ``delay``)."""


def delayed_bar(iterable: Iterable[T], *, desc: str, unit: str, enabled: bool, total: int | None = None) -> Iterator[T]:
    """``iterable`` under a tqdm bar that appears after :data:`BAR_DELAY_S` seconds, when ``enabled``."""
    return iter(tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, delay=BAR_DELAY_S, disable=not enabled))

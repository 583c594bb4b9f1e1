"""Fixtures for the per-example-gradient tests: tiny float64 networks, one CPU thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny problems run faster (and steadier on a busy machine) on one thread; restored afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(20181203)

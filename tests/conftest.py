"""Shared fixtures: composing the Hydra config in-process, shrunk to seconds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(autouse=True, scope="session")
def _offline() -> Iterator[None]:
    """Tests never touch the internet: downloads use the cache or a mirror only (download tests that
    serve files from 127.0.0.1 unset this themselves)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("BDL_BENCH_OFFLINE", "1")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    """One CPU thread: bit-for-bit repeatable, and no contention between tests on 2-core machines."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_hydra_job_state() -> Iterator[None]:
    """A test that runs a Hydra app in this process (a reproduce or sweep in-process) leaves Hydra's job config
    set, which the next test would read as its own job's (stacked jobs name their split folders from it)."""
    yield
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg(overrides)`` → the root config with those overrides (smoke trainer by default)."""

    def _compose(overrides: list[str] | None = None, smoke: bool = True) -> DictConfig:
        overrides = list(overrides or [])
        if smoke and not any(o.startswith("trainer=") for o in overrides):
            overrides.insert(0, "trainer=smoke")
        with initialize_config_dir(str(CONF), version_base="1.3"):
            return compose("config", overrides=overrides)

    return _compose


@pytest.fixture
def at_epoch_end(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[int], None]], AbstractContextManager[None]]:
    """``with at_epoch_end(hook):`` calls ``hook(epoch)`` at the end of every epoch of the fits within, after
    the epoch's history row and checkpoint are written (to simulate a crash, a SIGTERM, a vanished folder there)."""
    from bdl_bench.orchestration import runner

    @contextmanager
    def hooked(hook: Callable[[int], None]) -> Iterator[None]:
        original = runner.stop_if_terminated

        def stop_if_terminated(progress: object, epoch: int, *rest: object) -> None:
            hook(epoch)
            original(progress, epoch, *rest)

        with monkeypatch.context() as patch:
            patch.setattr(runner, "stop_if_terminated", stop_if_terminated)
            yield

    return hooked

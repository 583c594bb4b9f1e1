"""Datasets: one loader per name typed after ``data=`` (``uci/boston``, ``libsvm/a1a``, ``toy/cubic``).

Every submodule of this package is imported on first use, so adding a dataset means adding one module
that calls :func:`~bdl_bench.data.base.register_dataset`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Mapping
from typing import Any

from bdl_bench.data.base import DATASETS, DataFileError, Dataset, DatasetLoader, Task, default_data_root
from bdl_bench.errors import ConfigError

__all__ = [
    "DATASETS",
    "DataFileError",
    "Dataset",
    "Task",
    "available_datasets",
    "build_dataset",
    "default_data_root",
    "get_loader",
    "import_all_loaders",
]

IGNORED_KEYS = frozenset({"name", "protocol"})
"""Config keys that are not loader arguments (``protocol`` holds settings other code reads)."""

_imported = False


def import_all_loaders() -> None:
    """Import every submodule of :mod:`bdl_bench.data` once, so that all loaders are registered."""
    global _imported
    if _imported:
        return
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    _imported = True


def available_datasets() -> list[str]:
    """Sorted names of all registered datasets."""
    import_all_loaders()
    return sorted(DATASETS)


def get_loader(name: str) -> DatasetLoader:
    """The loader registered under ``name``.

    Raises:
        ValueError: If no dataset has that name; the message lists the available ones.
    """
    import_all_loaders()
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; available: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def _plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        DictConfig = None  # type: ignore[assignment,misc]  # noqa: N806
    if DictConfig is not None and isinstance(cfg, DictConfig):
        container = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(container, dict)
        return {str(k): v for k, v in container.items()}
    return dict(cfg)


def build_dataset(cfg: Mapping[str, Any]) -> Dataset:
    """Build the dataset described by the ``data`` config.

    Args:
        cfg: ``name`` (a registered dataset name) plus the loader's keyword arguments; a ``protocol``
            sub-mapping, if present, is ignored here (other code reads it).

    Returns:
        The loaded :class:`Dataset`.

    Raises:
        ValueError: On a missing or unknown ``name`` (listing the available names) or an option the loader
            does not accept (listing the accepted ones).
    """
    options = _plain(cfg)
    name = options.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"data config needs a 'name' (e.g. data=uci/boston); got {name!r}")
    loader = get_loader(name)
    kwargs = {k: v for k, v in options.items() if k not in IGNORED_KEYS}
    accepted = [
        p.name
        for p in inspect.signature(loader).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"dataset {name!r} does not accept option(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(accepted)}"
        )
    return loader(**kwargs)

"""Datasets: one loader per name typed after ``data=`` (``uci/boston``, ``libsvm/a1a``, ``toy/cubic``).

Every submodule of this package is imported on first use, so adding a dataset means adding one module
that calls :func:`~bdl_bench.data.base.register_dataset`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bdl_bench.data.base import DATASETS, Dataset, DatasetLoader
from bdl_bench.errors import ConfigError
from bdl_bench.registry import import_submodules, lookup

IGNORED_KEYS = frozenset({"name", "protocol"})
"""Config keys that are not loader arguments (``protocol`` holds settings other code reads)."""


def get_loader(name: str) -> DatasetLoader:
    """The loader registered under ``name``; an unknown name is a :class:`ConfigError` listing the known ones."""
    import_submodules(__name__)
    return lookup(DATASETS, name, "dataset")


def build_dataset(cfg: Mapping[str, Any]) -> Dataset:
    """Build the dataset of a ``data`` config: ``name`` plus the loader's keyword arguments (``protocol`` is
    ignored here; other code reads it). A missing or unknown name, or an option the loader does not accept, is a
    :class:`ConfigError` listing the choices."""
    options = dict(OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg)
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

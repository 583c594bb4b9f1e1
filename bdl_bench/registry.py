"""Name → builder tables that modules fill with a decorator (datasets, models, OOD sets), and the import of a
package's modules that makes them do so: adding a dataset or a model is adding one module."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, MutableMapping
from functools import cache
from typing import TypeVar

from bdl_bench.errors import ConfigError

T = TypeVar("T")


def registrar(table: MutableMapping[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """``register(name)``, a decorator that adds its function or class to ``table`` under ``name`` and returns it
    unchanged; a name registered twice is a bug (``ValueError`` naming the ``kind``)."""

    def register(name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in table:
                raise ValueError(f"{kind} name {name!r} is registered twice")
            table[name] = item
            return item

        return add

    return register


def lookup(table: Mapping[str, T], name: str, kind: str) -> T:
    """``table[name]``; an unknown name is a :class:`ConfigError` listing the known ones."""
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}; available: {', '.join(sorted(table))}")
    return table[name]


@cache
def import_submodules(package: str) -> None:
    """Import (once per process) every module of ``package`` whose name does not start with ``_``."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")

"""Inference methods: one module each, registered by the name of its ``conf/method`` YAML."""

from __future__ import annotations

import importlib
import pkgutil

from bdl_bench.methods.base import METHODS, Method, Problem, build_method, register_method

__all__ = ["METHODS", "Method", "Problem", "build_method", "register_method", "import_all"]


def import_all() -> None:
    """Import every submodule so that its ``@register_method`` runs (a new method is one file)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")

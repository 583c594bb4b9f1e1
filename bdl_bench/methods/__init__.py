"""Inference methods: one module each, registered by the name of its ``conf/method`` YAML."""

from __future__ import annotations

from bdl_bench.methods.base import METHODS, Method, Problem, build_method, register_method
from bdl_bench.registry import import_submodules

__all__ = ["METHODS", "Method", "Problem", "build_method", "register_method", "import_all"]


def import_all() -> None:
    """Import every submodule so that its ``@register_method`` runs (a new method is one file)."""
    import_submodules(__name__)

"""Structured Gaussians over a flat parameter vector: one class per parameterisation.

``StructuredGaussian`` (``base.py``) states the maths once; ``DiagGaussian``, ``LowRankPlusDiagGaussian`` (SLANG),
``FullGaussian`` and the block-diagonal Laplace structures (``blocks.py``, ``kron.py``, ``def_lowrank.py``) fill in
the structure. KL divergences dispatch on the pair of classes (``kl.py``); ``io.py`` saves and loads them.
"""

from __future__ import annotations

from bdl_bench.gaussians.base import LinearMoments, StructuredGaussian
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.gaussians.full import FullGaussian
from bdl_bench.gaussians.kl import kl, register_kl, sym_kl
from bdl_bench.gaussians.low_rank import LowRankPlusDiagGaussian

__all__ = [
    "DiagGaussian",
    "FullGaussian",
    "LinearMoments",
    "LowRankPlusDiagGaussian",
    "StructuredGaussian",
    "kl",
    "register_kl",
    "sym_kl",
]

"""Saving a posterior into a run folder and loading it back (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bdl_bench.gaussians.base import StructuredGaussian
from bdl_bench.gaussians.blocks import BlockDiagGaussian, BlockEigenGaussian
from bdl_bench.gaussians.def_lowrank import KroneckerLowRankPlusDiagGaussian
from bdl_bench.gaussians.diag import DiagGaussian
from bdl_bench.gaussians.full import FullGaussian
from bdl_bench.gaussians.kron import EigenKroneckerGaussian, KroneckerGaussian, ScaledEigenKroneckerGaussian
from bdl_bench.gaussians.low_rank import LowRankPlusDiagGaussian

CLASSES: dict[str, type[StructuredGaussian]] = {
    cls.__name__: cls
    for cls in (
        DiagGaussian,
        FullGaussian,
        LowRankPlusDiagGaussian,
        BlockDiagGaussian,
        BlockEigenGaussian,
        KroneckerGaussian,
        EigenKroneckerGaussian,
        ScaledEigenKroneckerGaussian,
        KroneckerLowRankPlusDiagGaussian,
    )
}


def gaussian_class(fields: set[str]) -> type[StructuredGaussian]:
    """The savable class whose dataclass fields are ``fields`` (a saved posterior's tensors)."""
    for cls in CLASSES.values():
        if {f.name for f in dataclasses.fields(cls)} == fields:
            return cls
    raise ValueError(f"no savable Gaussian has the fields {sorted(fields)}")


def save_gaussian(gaussian: StructuredGaussian, path: Path) -> None:
    """Write the defining tensors (``mean``, ``prec_*``) and the class name, atomically."""
    name = type(gaussian).__name__
    if name not in CLASSES:
        raise ValueError(f"cannot save {name}; savable: {', '.join(CLASSES)}")
    state = {f.name: getattr(gaussian, f.name).detach().cpu() for f in dataclasses.fields(gaussian)}
    from bdl_bench.checkpoint import atomic_torch_save

    atomic_torch_save({"class": name, "tensors": state}, Path(path))


def load_gaussian(path: Path) -> StructuredGaussian:
    """Inverse of :func:`save_gaussian`; loads tensors only (``weights_only=True``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    name = payload["class"]
    if name not in CLASSES:
        raise ValueError(f"{path}: unknown Gaussian class {name!r}; known: {', '.join(CLASSES)}")
    return CLASSES[name](**payload["tensors"])

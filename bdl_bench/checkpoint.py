"""Training checkpoints (docs/sweeps.md): what a killed run needs to continue exactly where it stopped, in one
file (``checkpoint.pt`` in the run folder) written atomically and read with ``torch.load(weights_only=True)``, so
it holds only tensors, numbers, strings and plain containers (:class:`Checkpoint`). It is never applied to another
config hash, and refused on another device type: generator states differ between CPU and CUDA. A finished run
removes it and keeps ``params.pt`` (:func:`save_params`), which ``method.map_dir`` of ``method=laplace`` reads."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bdl_bench.results import atomic_write_bytes


@dataclass(frozen=True)
class Checkpoint:
    """The state of an unfinished run after ``epoch`` complete epochs."""

    epoch: int
    config_hash: str
    method: dict[str, Any]  # Method.state_dict()
    generators: dict[str, Tensor]  # name -> torch.Generator.get_state() (CPU byte tensors)
    torch_rng: Tensor  # torch.get_rng_state()
    cuda_rng: Tensor | None  # torch.cuda.get_rng_state() of the run's device, when it is a GPU
    elapsed_s: float
    history_rows: int | list[int] | None = None  # rows of history.csv (one count per split for a stack)
    history: list[Any] = field(default_factory=list)  # the rows themselves: only in checkpoints before history_rows
    device: str | None = None  # the device type it was written on (cpu, cuda); None in older checkpoints


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` of ``obj`` to ``path`` atomically, via bytes in memory: a full disk is then an ``OSError``
    with its ``errno`` (``torch.save`` to a path fails with an opaque ``RuntimeError``) and the old file stays."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(Path(path), buffer.getbuffer())


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    atomic_torch_save(asdict(checkpoint), path)


def save_params(path: Path, theta: Tensor, *, method: str, config_hash: str) -> None:
    """Write a finished run's flat parameters ``theta`` (``(D,)``, ``model.parameters()`` order) atomically,
    as ``{"theta": (D,) CPU tensor, "method": name, "config_hash": hash}``."""
    payload = {"theta": theta.detach().cpu().clone(), "method": str(method), "config_hash": str(config_hash)}
    atomic_torch_save(payload, path)


def load_params(path: Path) -> dict[str, Any]:
    """Inverse of :func:`save_params` (``weights_only=True``, tensors on the CPU)."""
    payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    theta = payload.get("theta") if isinstance(payload, dict) else None
    if not isinstance(theta, Tensor) or theta.dim() != 1:
        raise ValueError(f"{path} is not a bdl-bench params file (no 1-d 'theta' tensor)")
    return payload


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path`` (tensors on the CPU), or ``None`` when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        return Checkpoint(**state)
    except TypeError as error:
        raise ValueError(
            f"{path} is not a bdl-bench checkpoint ({error}); delete it or re-run with force=true"
        ) from error

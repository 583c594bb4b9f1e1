"""A job's checkpoint: what it holds (the method's state, the generators, each member's history rows), which
checkpoint a job resumes from (or refuses, or discards), and restoring it."""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bdl_bench.checkpoint import Checkpoint, load_checkpoint
from bdl_bench.errors import ConfigError, UserError
from bdl_bench.methods import Method
from bdl_bench.results import CHECKPOINT_FILE, read_history


class CheckpointDeviceError(UserError, ValueError):
    """A checkpoint written on one device type (``cpu``, ``cuda``) found by a run on another."""


def job_checkpoint(path: Path, job_hash: str, single: bool, keys: Sequence[Hashable]) -> Checkpoint | None:
    """The job's checkpoint to resume from, if any. One of another config is refused for a single run; for a
    stack it is one of another set of unfinished members (e.g. left by a stack killed while writing its
    splits' results), discarded with a warning: the members start afresh."""
    checkpoint = load_checkpoint(path)
    if checkpoint is None or checkpoint.config_hash == job_hash:
        return checkpoint
    if single:
        raise ConfigError(
            f"{path} belongs to another config (hash {checkpoint.config_hash}, this run {job_hash}); "
            "delete it or re-run with force=true"
        )
    warnings.warn(
        f"{path} belongs to another stack of splits (hash {checkpoint.config_hash}, this job {job_hash}); "
        f"starting the splits {list(keys)} from scratch",
        stacklevel=4,
    )
    return None


def checkpoint_histories(checkpoint: Checkpoint, paths: Sequence[Path], single: bool) -> list[list[dict[str, Any]]]:
    """Each member's history rows at the checkpoint: read back from ``paths`` (their ``history.csv``), or
    the rows stored in a checkpoint written before checkpoints kept only the row counts."""
    if checkpoint.history_rows is None:
        return [list(checkpoint.history)] if single else list(checkpoint.history)
    counts = [checkpoint.history_rows] if single else checkpoint.history_rows
    return [read_history(p, int(n)) for p, n in zip(paths, counts)]  # type: ignore[arg-type, union-attr]


def make_checkpoint(
    epoch: int,
    chash: str,
    method: Method,
    generators: Mapping[str, torch.Generator],
    device: torch.device,
    history_rows: int | list[int],
    elapsed_s: float,
) -> Checkpoint:
    """What a killed run needs to continue after ``epoch``: the method's state, every generator's and
    torch's global (and CUDA) RNG state, the number of history rows so far (per split for a stack) and the
    time spent."""
    return Checkpoint(
        epoch=epoch,
        config_hash=chash,
        device=device.type,
        method=method.state_dict(),
        generators={name: gen.get_state() for name, gen in generators.items()},
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        history_rows=history_rows,
        elapsed_s=elapsed_s,
    )


def restore_checkpoint(
    checkpoint: Checkpoint, method: Method, generators: Mapping[str, torch.Generator], device: torch.device
) -> None:
    """Inverse of :func:`make_checkpoint` for a method already set up (history and time are the caller's);
    a checkpoint of another device type is refused (its generators' states do not fit this device's)."""
    if checkpoint.device is not None and checkpoint.device != device.type:
        raise CheckpointDeviceError(
            f"the run's {CHECKPOINT_FILE} was written on {checkpoint.device} and this run is on {device.type}: "
            f"a checkpoint resumes only on its own device type; re-run with trainer.device={checkpoint.device}, "
            "or with force=true to start over"
        )
    method.load_state_dict(checkpoint.method)
    for name, gen in generators.items():
        gen.set_state(checkpoint.generators[name])
    torch.set_rng_state(checkpoint.torch_rng)
    if checkpoint.cuda_rng is not None and device.type == "cuda":
        torch.cuda.set_rng_state(checkpoint.cuda_rng, device)

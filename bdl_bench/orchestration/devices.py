"""Where a run computes: ``trainer.device`` / ``trainer.dtype`` resolved, what run.json records of the device, the
deterministic-algorithms switch."""

from __future__ import annotations

import os
from typing import Any

import torch

from bdl_bench.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but no CUDA device is available; use trainer.device=auto or cpu")
    return device


def device_record(device: torch.device) -> dict[str, Any]:
    """What ``run.json`` records of the device a run used: its type (``cpu``, ``cuda``), the GPU's name,
    the torch and CUDA versions (results of different devices differ in the last digits), and the installed
    versions of the main packages (``packages``: Python, numpy, pandas, Hydra, Optuna, …)."""
    from bdl_bench.orchestration.catalogue import package_versions

    record: dict[str, Any] = {
        "device": device.type,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "packages": package_versions(),
    }
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    return record


def use_deterministic(on: bool) -> None:
    """``trainer.deterministic``: with ``on``, PyTorch's deterministic algorithms only (an op without one
    raises), TF32 off for matrix products and convolutions, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (what
    cuBLAS needs to repeat itself). A CPU run with one thread repeats bit for bit either way; this makes a GPU
    run repeat too, at some cost in speed. Process-wide; ``on=False`` does nothing."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"trainer.dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
